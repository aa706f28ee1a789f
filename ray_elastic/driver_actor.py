"""The driver actor: the asyncio shell around the pure `DriverCore` that carries its actions out.

Everything that happens reaches one queue as a typed message (a worker
ready, exited or dead, a discovery result, a reset request, a liveness
round, a tick). The loop takes what is queued as one batch, hands it to the
core, and carries out the actions that come back. Its parts, under `driver/shell/`:

- `worker_pool.py`: placement groups and worker actors, started, watched,
  killed and found again;
- `liveness.py`: the rounds of pings and the node probes that read the CPU
  time of a worker that missed one;
- `cluster_facts.py`: discovery, draining nodes, and the questions that
  take time (activity, checkpoint, node table), each answered by a message;
- `kv_link.py`: generations published to the KV actor, and its restarts;
- `autoscale_share.py`: the run's share of the autoscaler request;
- `durability.py`: the snapshot after each batch, and calls answered only
  once a snapshot holds them, so the driver survives its own death;
- `inbox.py`: the queue, taken as batches; deaths completed by their
  node's fate once per batch, so deaths that arrive together join one reset.

The driver survives its own death: Ray restarts the actor and sends it
again the calls it had not answered, among them `fit()`'s `run()`. A
restarted driver loads its snapshot, finds its workers by name, and asks
again what may have been lost (`DriverCore.restarted`). Workers orphaned by
a driver dead for good (when `fit()`'s caller dies, Ray kills the driver
with it) remove the run's actors and placement groups themselves
(`worker_actor.py`).

Ray hosts it through `driver_host.DriverHost`, a thin class whose module
imports nothing of the driver: Ray imports a hosted class in every process
that unpickles a handle to it, every worker among them.

Every await has a deadline (the parts' docstrings name each); the one
without is a worker's `run()` call, which lasts as long as training; the
liveness pings bound it instead.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic import metrics, ray_private
from ray_elastic.auth import Authed, RunToken
from ray_elastic.discovery import DiscoveryError
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.driver_core import DriverCore, WorkerStatus
from ray_elastic.driver.shell import cluster_facts, snapshot
from ray_elastic.driver.shell.autoscale_share import AutoscaleShare
from ray_elastic.driver.shell.durability import (
    CallLedger,
    DurableChanges,
    MetricSeqs,
    NoAnswerError,
    judge_snapshot,
    within,
)
from ray_elastic.driver.shell.inbox import TICK_S, Inbox
from ray_elastic.driver.shell.kv_link import KVLink
from ray_elastic.driver.shell.liveness import LivenessRounds
from ray_elastic.driver.shell.metrics_log import MetricsLog
from ray_elastic.driver.shell.worker_pool import WorkerPool
from ray_elastic.protocol import DriverStatus, RunOutcome
from ray_elastic.session_log import keep_in_session_log
from ray_elastic.shipping import unpack
from ray_elastic.wire import Told, ToldMessage
from ray_elastic.worker_actor import actor_class

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.config import RunConfig

logger = logging.getLogger(__name__)


class DriverActor:
    """The run's driver, held by the class Ray hosts (`driver_host.DriverHost`); methods run on one loop."""

    def __init__(self, token: RunToken, run_id: str, namespace: str, config: RunConfig) -> None:
        """Plain values only, which Ray keeps with the actor for its restarts (`_load_start` finds the rest).

        `token`: the run's token, which the host checked on every call and which this driver's own calls carry.
        """
        self._run_token = token
        keep_in_session_log(f"driver-{run_id}")  # its lines in Ray's logs; fit() shows the events (logs.py)
        self.run_id = run_id
        self.namespace = namespace
        self.config = config
        self.core = DriverCore(config, wall_offset=time.time() - time.monotonic(), started_at=time.monotonic())
        self.metrics = MetricsLog(run_id)
        self._metric_seqs = MetricSeqs()  # per worker that reported: the metrics batches taken
        self._metrics_written: tuple[int, int] | None = None  # the reports and sequence numbers the snapshot holds
        self._changes = DurableChanges()
        self.ledger = CallLedger(run_id, self._run_token)
        self.inbox = Inbox(config, self.ledger, lambda worker_id: self.core.host_of(worker_id))
        self.pool = WorkerPool(namespace, config, self._run_token, self.inbox.put, actor_class())
        self.liveness = LivenessRounds(config, self.pool, lambda: self.core.alive_hosts(), self.inbox.put)
        self.kv: KVLink | None = None  # found by name (`_load_start`)
        self._discovery_spec: Any = None
        self._tasks: list[asyncio.Task] = []
        self.autoscale = AutoscaleShare(run_id, config)
        self._started = asyncio.Event()  # the core is the run's: fresh, or loaded from the snapshot
        self._drive_task: asyncio.Task | None = None

    # ---- the loop ----------------------------------------------------------------
    async def run(self) -> RunOutcome:
        """Drive the run to its end; returns the outcome the trainer turns into a Result."""
        return await asyncio.shield(self._driving())

    def _driving(self) -> asyncio.Task:
        """The one task that drives the run, started by whichever call reaches this driver first.

        A restarted driver is sent again every call its predecessor left
        unanswered, in any order. The workers' calls wait for the loop to
        snapshot their message: were the loop started by `fit()`'s `run()`
        alone, workers' calls filling every slot (`max_concurrency`) first
        would wait forever for a `run()` that never gets one.
        """
        if self._drive_task is None:
            self._drive_task = asyncio.get_running_loop().create_task(self._drive())
        return self._drive_task

    async def _drive(self) -> RunOutcome:
        # what the process holds by now (Ray, its modules) lives as long as it does: moved out of the cyclic
        # GC's sight, a full collection scans only the run's own objects, so the loop's stalls it causes grow
        # with the run, not with Ray (bench/driver_scale.py measures them)
        gc.collect()
        gc.freeze()
        try:
            try:
                await self._load_start()
            except snapshot.StartError as e:  # forged, or gone with the run: nothing to start from
                self._fail(str(e))
            else:
                await self._loop()
        except NoAnswerError as e:  # a restart's bounded wait on the GCS or the KV actor ran out: named
            self._fail(str(e))
        except Exception as e:  # noqa: BLE001 - a driver bug must still end the run with its reason
            logger.exception("driver failed")
            self._fail(f"internal error in the driver: {type(e).__name__}: {e}")
        finally:
            for task in self._tasks:
                task.cancel()
            self._started.set()
            self.ledger.answer_all()
            self._cleanup()
        return self.core.outcome(*self.metrics.fetch(0))

    async def _load_start(self) -> None:
        """Find the run's KV actor by name, take train_fn's payload and the discovery spec from the GCS.

        None of them is a constructor argument: Ray would keep an actor handle
        or a large argument in the object store, under `fit()`'s process, and
        a restart would hang on it once it is lost. Each within `KV_BACK_S`.
        """
        loop = asyncio.get_running_loop()
        try:
            kv = await within(
                "find the run's KV actor by name", loop.run_in_executor(None, ray.get_actor, "kv", self.namespace)
            )
        except ValueError as e:
            raise snapshot.StartMissingError(f"the run's KV actor is gone ({e}): the run ended") from e
        kv = Authed(kv, self._run_token)
        self.kv = KVLink(kv, self.pool, self.inbox.put)
        self.ledger.confirm = kv.confirm_snapshot.remote  # not awaited: a lost confirmation refutes nothing
        payload, discovery = await within(
            "read train_fn's payload and the discovery spec from the GCS",
            loop.run_in_executor(None, snapshot.load_start, self.run_id, self._run_token),
        )
        # the handle workers call back on (the host's) carries the run's token
        me = Authed(ray.get_runtime_context().current_actor, self._run_token)
        self.pool.start_args = (kv, me, self.config.worker(self.run_id))
        self.pool.payload_ref = ray.put(payload)
        # callables arrive pickled by the trainer (their module may exist only on its side)
        self._discovery_spec = unpack(discovery) if isinstance(discovery, bytes) else discovery

    async def _loop(self) -> None:
        """Start or resume the run, then apply what happens, batch by batch, until it ends."""
        loop = asyncio.get_running_loop()
        resumed = await within("ask the GCS whether Ray restarted it", loop.run_in_executor(None, _restarted))
        poller = cluster_facts.make_poller(self._discovery_spec, self.config, resumed)
        if resumed:
            actions = await self._resume()
        else:
            try:
                hosts = await cluster_facts.poll(poller)  # a fresh run's first poll raises rather than say None
                first: list[m.Message] = [m.HostsDiscovered(hosts) if hosts is not None else m.Tick()]
            except DiscoveryError as e:
                first = [m.DiscoveryFailed(str(e))]
            actions = self.core.handle(first, time.monotonic())
            await self._persist()
        self._started.set()
        await self._carry_out(actions)
        if not self.core.state.is_final:
            report = self.inbox.put
            for coro in (
                cluster_facts.discovery_loop(poller, self.config, report),
                self.liveness.run(),
                self._kv().watch(lambda: self.core.generation),
                self.autoscale.renew(),
                cluster_facts.drain_loop(self.config, report),
            ):
                self._tasks.append(asyncio.create_task(coro))
        last_tick = time.monotonic()
        while not self.core.state.is_final:
            batch = await self.inbox.next_batch()
            now = time.monotonic()
            if now - last_tick >= TICK_S:
                batch.append(m.Tick())
                last_tick = now
            actions = self.core.handle(batch, now)
            # before the actions: a restarted driver asks again what they may have lost
            await self._persist(core_changed=self._changes.seen(batch, actions))
            await self._carry_out(actions)

    # ---- durability --------------------------------------------------------------------
    async def _persist(self, core_changed: bool = True) -> None:
        """Snapshot the core and the metrics, then answer the calls it holds; a GCS that refuses fails the run."""
        # reports taken since the last snapshot (what fit() fetched meanwhile waits for the next one)
        taken = (len(self.metrics), self._metric_seqs.version)
        rest_changed, self._metrics_written = taken != self._metrics_written, taken
        why = await self.ledger.persist(self.core, (self.metrics, self._metric_seqs), core_changed, rest_changed)
        if why is not None:
            self._fail(f"the GCS did not take the driver's snapshot ({why}); the run cannot survive a restart")

    async def _take(self, message: m.Message | None) -> None:
        """Queue a call's message; return once a snapshot holds it.

        A driver that dies first leaves the call unanswered: Ray sends it again to the restarted one.
        """
        self._driving()
        if self.core.state.is_final:
            return
        received, answered = self.ledger.receive(message)
        self.inbox.put(received)
        await answered

    async def _resume(self) -> list[m.Action]:
        """Ray restarted this driver: load the snapshot, find the workers, and say what to ask again."""
        try:
            saved = await self.ledger.load()
        except snapshot.ForgedSnapshotError as e:
            self._fail(str(e))
            return []
        if saved is None:
            self._fail("the run's driver actor restarted before it had saved any state; the run cannot go on")
            return []
        kv = self._kv().kv
        kv_generation = await within("ask the KV actor its generation", kv.current_generation.remote())
        confirmed = await within("ask the KV actor its newest snapshot", kv.snapshot_confirmed.remote())
        refused = judge_snapshot(self.ledger.written, saved[0].generation, confirmed, kv_generation)
        if refused is not None:  # the fresh core tells it: nothing of the old snapshot is taken
            self.core.handle([m.SnapshotRefused(refused)], time.monotonic())
            return []
        self.core, self.metrics, self._metric_seqs = saved
        logger.warning("the driver restarted: resuming generation %d from its snapshot", self.core.generation)
        # a KV actor that restarted while no driver watched it holds no generation: the core learns of it
        # (an older, non-zero one only means the dead driver's publish was cut short: restored below)
        if self.core.generation and kv_generation == 0:
            self.inbox.put(m.KVRestarted("it restarted while the driver was down"))
        actions = self.core.restarted(time.monotonic(), "its process died; Ray restarted it")
        await self._persist()
        alive = {w: (self.core.workers[w].host, self.core.workers[w].status) for w in self.core.alive_ids()}
        await within("find its workers again", self.pool.reattach(alive))
        # the notice of the current generation, if the dead driver had not sent it
        self.pool.notify(self.core.plan, self.core.generation)
        return actions

    # ---- carrying out actions --------------------------------------------------------
    async def _carry_out(self, actions: list[m.Action]) -> None:
        for action in actions:
            if isinstance(action, m.Spawn):
                self.pool.spawn(action.worker_id, action.host, spare=action.spare)
            elif isinstance(action, m.Kill):
                self.pool.kill(action.worker_id)
                self._release(action.worker_id)
            elif isinstance(action, m.Release):
                self._release(action.worker_id)
            elif isinstance(action, m.Publish):
                await self._kv().publish(action)
            elif isinstance(action, m.RestoreKV):
                await self._kv().restore(action)
            elif isinstance(action, m.Abandon):
                self.pool.abandon(action)
            elif isinstance(action, m.QueryActivity):
                self._background(cluster_facts.query_activity(action, self.pool.handles, self.config, self.inbox.put))
            elif isinstance(action, m.LookForCheckpoint):
                self._background(cluster_facts.look_for_checkpoint(self.config, self.inbox.put))
            elif isinstance(action, m.RequestResources):
                await self.autoscale.set(action.bundles)
            elif isinstance(action, m.RecordMetric):
                _RECORDERS[action.name](self.run_id, action.value)
            else:
                raise TypeError(f"the driver shell got an unknown action {action!r}")

    def _background(self, coro: Any) -> None:
        """Run `coro` beside the loop (cancelled when the run ends); the finished ones are let go."""
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(coro))

    def _fail(self, reason: str) -> None:
        """The shell's own error ends the run: told to the core as a message, as everything that happens is."""
        self.core.handle([m.DriverFailed(reason)], time.monotonic())

    def _kv(self) -> KVLink:
        """The link to the run's KV actor, found by name before the loop starts (`_load_start`)."""
        if self.kv is None:
            raise RuntimeError("the driver used the run's KV actor before it found it (_load_start)")
        return self.kv

    def _release(self, worker_id: str) -> None:
        """The worker is gone: the pool lets it go, and its metrics' sequence numbers unless it finished."""
        self.pool.release(worker_id)
        rec = self.core.workers.get(worker_id)
        if rec is None or rec.status is not WorkerStatus.FINISHED:  # rank 0's last batches may still be resent
            self._metric_seqs.forget(worker_id)

    # ---- called by workers and the trainer --------------------------------------------
    # each answered once a snapshot holds it: a restarted driver gets again what its predecessor did not save
    async def tell(self, message: ToldMessage) -> None:
        """What happened to one of the run's actors (`wire.py`: one class per fact), for the core as it is."""
        if not isinstance(message, Told):
            raise TypeError(f"DriverActor.tell takes a ray_elastic.wire message, got {type(message).__name__}")
        await self._take(message)

    async def add_metrics(
        self, worker_id: str, batch: list[tuple[float, dict]], seq: int | None = None, paces: list | None = None
    ) -> None:
        """Rank 0's reports, and any rank's pace summaries (`paces`, for the core's straggler watch).

        `seq` numbers the sender's batches, so one sent again after a restart counts once.
        """
        self._driving()
        await self._started.wait()
        if self.core.is_void(worker_id):  # declared dead (e.g. cut off, then healed): it no longer speaks for rank 0
            logger.info("dropped %d metric reports of worker %s, declared dead", len(batch), worker_id)
            return
        if seq is not None and not self._metric_seqs.take(worker_id, seq, reports=bool(batch)):
            return  # taken and saved by this driver's predecessor
        if batch:
            self.metrics.add(batch)
        await self._take(m.PacesReported(worker_id, tuple(paces)) if paces else None)

    async def stop(self, reason: str = "stopped by the user") -> None:
        """Ask the loop to end (e.g. the user interrupted `fit()`)."""
        self.inbox.put(m.Stop(reason))

    async def status(self, metrics_since: int = 0, events_since: int = 0) -> DriverStatus:
        """A snapshot for progress display: state, world size, and what the caller has not seen yet.

        The reports from `metrics_since` on (the ones before were fetched by
        the caller: the driver lets them go), and the events from run-wide
        number `events_since` on, with any older one whose reset has not ended.
        """
        self._driving()
        await self._started.wait()  # a restarted driver answers from its snapshot, not from an empty core
        first, reports = self.metrics.fetch(metrics_since)
        events_from, events = self.core.events.since(events_since)
        return DriverStatus(
            state=self.core.state,
            generation=self.core.generation,
            world_size=len(self.core.plan),
            resets=self.core.resets,
            metrics=reports,
            metrics_from=first,
            num_metrics=len(self.metrics),
            events=[e.to_dict() for e in events],
            events_from=events_from,
            spares=self.core.spares_ready,
        )

    def _cleanup(self) -> None:
        """Kill every worker still running, free every placement group, withdraw the autoscaler request."""
        self.pool.close()
        self.liveness.close()
        self.autoscale.withdraw()


_RECORDERS: dict[str, Callable[[str, float], None]] = {
    "world_size": lambda run_id, value: metrics.world_size(run_id, int(value)),
    "reset": lambda run_id, value: metrics.reset(run_id),
    "recovery": metrics.recovery,
}


def _restarted() -> bool:
    """Whether Ray restarted this actor (what `was_current_actor_reconstructed` reads, without its warning)."""
    info = ray_private.actor_record(ray.get_runtime_context().get_actor_id())
    return bool(info) and info.get("NumRestarts", 0) != 0
