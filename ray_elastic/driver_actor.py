"""The driver actor: one asyncio loop that owns the membership of a run.

States (`DriverState`): WAITING for `min_workers` ready workers, RUNNING a
generation, RESETTING (a new generation is published and its ranks are still
syncing), then DONE or FAILED. Everything that happens reaches the loop as a
message on one queue (discovery results, a worker ready, a worker's exit or
death, a reset request, a periodic tick), and the loop alone changes state,
so no decision races another. What to change is decided by the pure
functions of `assignment.py`; this module carries the decisions out:

- placement: one placement group (one bundle of `resources_per_worker`)
  pinned to its node, and one worker actor in it, per slot;
- deaths: learned from Ray at once (the pending `run()` call fails), the
  host cooled down unless its node died, a new generation published;
- additions: newcomers boot while the others keep training; the new
  generation is published, and the others notified, only once every newcomer
  is ready, so the survivors' pause is the rendezvous and the sync;
- removals: the new generation leaves the departing workers out, and they
  exit cleanly at the next `check_host_updates()`;
- liveness: a worker that does not answer a ping within `liveness_timeout`
  is killed, which turns a hang into an ordinary failure.

Every wait is bounded: `elastic_timeout` for `min_workers`, the boot of a
newcomer and placement; `reset_limit` bounds the number of resets.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import cloudpickle
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_elastic import metrics
from ray_elastic.assignment import Cooldown, LiveWorker, assign_ranks, plan_scaling
from ray_elastic.checkpoint import CheckpointStore
from ray_elastic.discovery import DiscoveryError, DiscoveryPoller, alive_ray_nodes, make_discovery
from ray_elastic.events import Event
from ray_elastic.worker_actor import actor_class
from ray_elastic.worker_context import WorkerSettings

logger = logging.getLogger(__name__)

_TICK_S = 0.5
_RATE_WINDOW_S = 5.0  # steps per second: rank 0's reports over this many seconds
_RATE_WINDOW_REPORTS = 10_000


class DriverState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RESETTING = "resetting"
    DONE = "done"
    FAILED = "failed"


class WorkerStatus(enum.Enum):
    STARTING = "starting"  # placement group, actor start, train_fn set-up
    READY = "ready"  # entered the run loop, waits to be admitted
    MEMBER = "member"  # part of the current generation
    LEAVING = "leaving"  # left out of the next generation, exits at its next check
    FINISHED = "finished"  # train_fn returned
    GONE = "gone"  # died, removed or killed


_ALIVE = (WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.MEMBER, WorkerStatus.LEAVING)


@dataclass(frozen=True)
class DriverSettings:
    """The trainer's options, as the driver needs them."""

    min_workers: int
    max_workers: int
    resources_per_worker: dict[str, float]
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] = (10.0, 300.0)
    discovery_interval: float = 1.0
    discovery_timeout: float = 30.0
    liveness_timeout: float = 30.0
    max_failures: int = 0
    worker: WorkerSettings = field(default_factory=WorkerSettings)


@dataclass
class WorkerRecord:
    worker_id: str
    host: str
    seq: int
    status: WorkerStatus
    started_at: float
    pg: PlacementGroup | None = None
    handle: Any = None
    task: asyncio.Task | None = None
    answered: bool = False  # has answered a ping: its process is up


class DriverActor:
    """Wrapped by `ray.remote` in `create_driver_actor`; methods run on one loop."""

    def __init__(
        self,
        run_id: str,
        namespace: str,
        kv: Any,
        payload: bytes,
        discovery: Any,
        settings: DriverSettings,
    ) -> None:
        self.run_id = run_id
        self.namespace = namespace
        self.kv = kv
        # workers tag their metrics with the run's id
        self.settings = replace(settings, worker=replace(settings.worker, run_id=run_id))
        self._payload_ref = ray.put(payload)
        # callables arrive pickled by the trainer (their module may exist only on its side)
        self._discovery_spec = cloudpickle.loads(discovery) if isinstance(discovery, bytes) else discovery
        self.state = DriverState.WAITING
        self.failure: str | None = None
        self.generation = 0
        self.plan: dict[str, Any] = {}
        self.resets = 0
        self.workers: dict[str, WorkerRecord] = {}
        self.hosts: dict[str, int] = {}
        self.host_first_seen: dict[str, float] = {}
        self.cooldown = Cooldown(*settings.cooldown_range)
        self.events: list[Event] = []
        self.metrics: list[tuple[float, dict]] = []
        self.return_value: Any = None
        self._seq = 0
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._waiting_since = time.monotonic()
        self._finishing = False
        self._unbound_events: list[Event] = []  # changes not yet absorbed by a generation
        self._syncing: set[str] = set()  # members of the newest generation still syncing
        self._autoscale_requested = 0
        self._user_failures = 0
        self._last_timeout_reset: float | None = None  # when a ring last broke with everyone alive
        self._worker_cls = actor_class()

    # ---- the loop ------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Drive the run to its end; returns the outcome the trainer turns into a Result."""
        self._queue = asyncio.Queue()
        self._started_at = time.time()
        self._self_handle = ray.get_runtime_context().current_actor
        try:
            poller = DiscoveryPoller(
                make_discovery(
                    self._discovery_spec, self.settings.resources_per_worker, self.settings.discovery_timeout
                ),
                give_up_after=self.settings.elastic_timeout,
                timeout=self.settings.discovery_timeout,
            )
            try:
                self._update_hosts(await self._poll(poller))
            except DiscoveryError as e:
                self._fail(str(e))
                return self._outcome()
            self._set_state(DriverState.WAITING)
            self._tasks.append(asyncio.create_task(self._discovery_loop(poller)))
            self._tasks.append(asyncio.create_task(self._liveness_loop()))
            self._tasks.append(asyncio.create_task(self._watch_kv()))
            await self._reconcile()
            while self.state not in (DriverState.DONE, DriverState.FAILED):
                try:
                    message = await asyncio.wait_for(self._queue.get(), _TICK_S)
                except asyncio.TimeoutError:
                    message = ("tick",)
                await self._handle(message)
        except Exception as e:  # noqa: BLE001 - a driver bug must still end the run with its reason
            logger.exception("driver failed")
            self._fail(f"internal error in the driver: {type(e).__name__}: {e}")
        finally:
            for task in self._tasks:
                task.cancel()
            await self._cleanup()
        return self._outcome()

    async def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "tick":
            await self._reconcile()
            self._check_deadlines()
        elif kind == "hosts":
            self._update_hosts(message[1])
            await self._reconcile()
        elif kind == "ready":
            rec = self.workers.get(message[1])
            if rec is not None and rec.status is WorkerStatus.STARTING:
                rec.status = WorkerStatus.READY
                rec.answered = True  # its process is up: from now on the liveness check applies
                await self._maybe_publish()
        elif kind == "exit":
            await self._on_exit(message[1], message[2])
        elif kind == "died":
            await self._on_died(message[1], message[2])
            # deaths already queued (a node's workers die together) join the same reset
            others = []
            while not self._queue.empty():
                queued = self._queue.get_nowait()
                if queued[0] == "died":
                    await self._on_died(queued[1], queued[2])
                else:
                    others.append(queued)
            for queued in others:
                self._queue.put_nowait(queued)
            await self._maybe_publish()
            await self._reconcile()
        elif kind == "reset_request":
            await self._on_reset_request(*message[1:])
        elif kind == "fatal":
            self._fail(message[1])
        elif kind == "stop":
            self._fail(message[1])

    def _set_state(self, state: DriverState) -> None:
        if state is not self.state:
            logger.info("driver: %s -> %s", self.state.value, state.value)
            if state is DriverState.WAITING:
                self._waiting_since = time.monotonic()
            self.state = state

    def _fail(self, reason: str) -> None:
        if self.state not in (DriverState.DONE, DriverState.FAILED):
            logger.error("run %s failed: %s", self.run_id, reason)
            self.failure = reason
            self.state = DriverState.FAILED

    # ---- discovery and scaling -------------------------------------------
    async def _poll(self, poller: DiscoveryPoller) -> dict[str, int] | None:
        # the poller bounds each call by discovery_timeout and applies the retry policy
        return await asyncio.get_running_loop().run_in_executor(None, poller.poll)

    async def _discovery_loop(self, poller: DiscoveryPoller) -> None:
        while True:
            await asyncio.sleep(self.settings.discovery_interval)
            try:
                hosts = await self._poll(poller)
            except DiscoveryError as e:
                self._queue.put_nowait(("fatal", str(e)))
                return
            if hosts is not None:
                self._queue.put_nowait(("hosts", hosts))

    def _update_hosts(self, hosts: dict[str, int] | None) -> None:
        if hosts is None:
            return
        now = time.monotonic()
        for host in hosts:
            self.host_first_seen.setdefault(host, now)
        self.hosts = dict(hosts)

    def _live(self, *statuses: WorkerStatus) -> list[WorkerRecord]:
        return [r for r in self.workers.values() if r.status in statuses]

    async def _reconcile(self) -> None:
        """Bring the workers in line with the hosts: start newcomers, let leavers go."""
        if self._finishing or self.state in (DriverState.DONE, DriverState.FAILED):
            return
        staying = self._live(WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.MEMBER)
        decision = plan_scaling(
            [LiveWorker(r.worker_id, r.host, r.seq) for r in staying],
            self.hosts,
            self.host_first_seen,
            self.cooldown.cooling(time.monotonic()),
            self.settings.max_workers,
        )
        leaving = []
        for worker_id in decision.remove:
            rec = self.workers[worker_id]
            if rec.status is WorkerStatus.MEMBER:
                rec.status = WorkerStatus.LEAVING
                leaving.append(f"{worker_id} on node {rec.host[:8]}")
            else:
                self._kill(rec)
        if leaving:
            self._unbound_events.append(self._event("hosts_removed", f"hosts withdrawn: {', '.join(leaving)} leave"))
        added = 0
        for host, count in decision.add.items():
            for _ in range(count):
                self._spawn(host)
                added += 1
        if added and self.generation > 0:
            self._unbound_events.append(self._event("hosts_added", f"{added} new worker(s)"))
        self._request_autoscale()
        if decision.remove:
            await self._maybe_publish()

    def _request_autoscale(self) -> None:
        """Ask Ray's autoscaler for the slots still missing up to max_workers."""
        offered = sum(self.hosts.values())
        wanted = self.settings.max_workers if offered < self.settings.max_workers else 0
        if wanted == self._autoscale_requested:
            return
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[self.settings.resources_per_worker] * wanted)
            self._autoscale_requested = wanted
        except Exception as e:  # noqa: BLE001 - a cluster without an autoscaler simply does not grow
            logger.debug("autoscaler request failed: %s", e)
            self._autoscale_requested = wanted

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self.state is DriverState.WAITING and now - self._waiting_since > self.settings.elastic_timeout:
            members = len(self._live(WorkerStatus.READY, WorkerStatus.MEMBER))
            self._fail(
                f"min_workers={self.settings.min_workers} not reached within elastic_timeout="
                f"{self.settings.elastic_timeout:g} s (ready workers: {members}; slots offered: "
                f"{sum(self.hosts.values())}; hosts cooling down: {len(self.cooldown.cooling(now))})"
            )
        for rec in self._live(WorkerStatus.STARTING):
            if now - rec.started_at > self.settings.elastic_timeout:
                logger.warning(
                    "worker %s did not become ready within %g s; killing it",
                    rec.worker_id,
                    self.settings.elastic_timeout,
                )
                self._kill(rec, failed=True)

    # ---- workers -------------------------------------------------------
    def _spawn(self, host: str) -> None:
        self._seq += 1
        worker_id = f"w{self._seq}"
        rec = WorkerRecord(worker_id, host, self._seq, WorkerStatus.STARTING, time.monotonic())
        rec.pg = placement_group(
            [dict(self.settings.resources_per_worker)],
            strategy="STRICT_PACK",
            name=f"{self.namespace}-{worker_id}",
            bundle_label_selector=[{"ray.io/node-id": host}],
        )
        self.workers[worker_id] = rec
        rec.task = asyncio.create_task(self._run_worker(rec))
        logger.info("starting worker %s on node %s", worker_id, host[:8])

    async def _run_worker(self, rec: WorkerRecord) -> None:
        try:
            await asyncio.wait_for(rec.pg.ready(), self.settings.elastic_timeout)
        except asyncio.TimeoutError:
            self._queue.put_nowait(("died", rec.worker_id, "its placement group was not placed in time"))
            return
        res = dict(self.settings.resources_per_worker)
        rec.handle = self._worker_cls.options(
            name=rec.worker_id,
            namespace=self.namespace,
            num_cpus=res.pop("CPU", 0),
            num_gpus=res.pop("GPU", 0),
            memory=res.pop("memory", None),
            resources=res or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(rec.pg, placement_group_bundle_index=0),
        ).remote(rec.worker_id, self.kv, self._self_handle, self.settings.worker)
        try:
            outcome = await rec.handle.run.remote(self._payload_ref)
        except Exception as e:  # noqa: BLE001 - ActorDiedError and kin: the worker is gone
            self._queue.put_nowait(("died", rec.worker_id, f"{type(e).__name__}: {_first_line(e)}"))
        else:
            self._queue.put_nowait(("exit", rec.worker_id, outcome))

    def _kill(self, rec: WorkerRecord, failed: bool = False) -> None:
        """Stop a worker now.

        With `failed`, a started worker is left to the failure path: its pending
        `run()` call fails and `_on_died` cools its host down and re-forms the ring.
        """
        if rec.handle is not None:
            ray.kill(rec.handle, no_restart=True)
            if failed:
                return
        elif rec.task is not None:
            rec.task.cancel()
        rec.status = WorkerStatus.GONE
        self._release(rec)

    def _release(self, rec: WorkerRecord) -> None:
        if rec.pg is not None:
            try:
                remove_placement_group(rec.pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
            rec.pg = None

    async def _on_exit(self, worker_id: str, outcome: dict[str, Any]) -> None:
        rec = self.workers[worker_id]
        kind = outcome.get("kind")
        if kind == "coordinator_died":
            self._fail(outcome["error"])
            return
        if kind == "error":
            slot = self.plan.get(worker_id)
            where = f"rank {slot.rank} " if slot is not None else ""
            text = f"train_fn raised in worker {worker_id} ({where}on node {rec.host[:8]}): {outcome['error']}"
            if self._user_failures < self.settings.max_failures:
                # the user asked for retries (flaky hardware): handle it as this worker's failure
                self._user_failures += 1
                logger.warning(
                    "%s (retry %d of max_failures=%d)\n%s",
                    text,
                    self._user_failures,
                    self.settings.max_failures,
                    outcome["traceback"],
                )
                ray.kill(rec.handle, no_restart=True)
                retry = f"retry {self._user_failures} of max_failures={self.settings.max_failures}"
                await self._on_died(worker_id, f"{outcome['error']} ({retry})", f"raised {outcome['error']} ({retry})")

                await self._maybe_publish()
                await self._reconcile()
                return
            self._fail(f"{text}\n{outcome['traceback']}")
            return
        rec.status = WorkerStatus.FINISHED if kind == "done" else WorkerStatus.GONE
        ray.kill(rec.handle, no_restart=True)
        self._release(rec)
        if kind == "done":
            self._finishing = True
            if outcome.get("rank") == 0:
                self.return_value = outcome.get("value")
            for starting in self._live(WorkerStatus.STARTING, WorkerStatus.READY):
                self._kill(starting)
            if not self._live(WorkerStatus.MEMBER, WorkerStatus.LEAVING):
                self._set_state(DriverState.DONE)

    async def _on_died(self, worker_id: str, reason: str, what: str = "died") -> None:
        rec = self.workers[worker_id]
        if rec.status not in _ALIVE:
            return
        was_member = rec.status in (WorkerStatus.MEMBER, WorkerStatus.LEAVING)
        rec.status = WorkerStatus.GONE
        self._release(rec)
        loop = asyncio.get_running_loop()
        alive_nodes = {n.node_id for n in await loop.run_in_executor(None, alive_ray_nodes)}
        node_alive = rec.host in alive_nodes
        if node_alive:
            cooldown = self.cooldown.record_failure(rec.host, time.monotonic())
            note = f"; node cooling down for {cooldown:g} s"
        else:
            self.hosts.pop(rec.host, None)
            note = "; its node is gone"
        slot = self.plan.get(worker_id)
        where = f"rank {slot.rank}" if slot is not None else "newcomer"
        logger.warning("worker %s (%s) on node %s died: %s%s", worker_id, where, rec.host[:8], reason, note)
        if was_member:
            self._unbound_events.append(
                self._event("worker_failed", f"worker {worker_id} ({where}) on node {rec.host[:8]} {what}{note}")
            )
        else:
            # a newcomer lost before it joined: a fault, but nobody trained with it, so no reset
            ev = self._event(
                "newcomer_failed", f"worker {worker_id} on node {rec.host[:8]} {what} before joining{note}"
            )
            ev.reset_duration = 0.0
            self.events.append(ev)
        if self._finishing and not self._live(WorkerStatus.MEMBER, WorkerStatus.LEAVING):
            self._set_state(DriverState.DONE)

    async def _on_reset_request(self, worker_id: str, generation: int, reason: str) -> None:
        """A rank's ring broke. Usually a death explains it; if every member answers, re-form the ring."""
        if generation != self.generation or self.state in (DriverState.DONE, DriverState.FAILED):
            return
        members = [self.workers[w] for w in self.plan]
        if any(r.status not in _ALIVE for r in members):
            return  # a death explains it, and its handler re-forms the ring
        # one query per member: its answer proves it alive and tells whether it is inside a collective
        activity = await asyncio.gather(
            *[asyncio.wait_for(r.handle.activity.remote(), self.settings.liveness_timeout) for r in members],
            return_exceptions=True,
        )
        for rec, result in zip(members, activity, strict=True):
            if isinstance(result, asyncio.TimeoutError):
                logger.warning("worker %s did not answer during a reset; killing it", rec.worker_id)
                self._kill(rec, failed=True)
        if generation != self.generation or any(isinstance(r, BaseException) for r in activity):
            return
        # everyone answers: a member that has not touched a collective for half the collective
        # timeout while the others timed out is stuck in user code (a deadlock): it held the ring up
        limit = self.settings.worker.collective_timeout / 2
        stuck = [
            rec
            for rec, act in zip(members, activity, strict=True)
            if isinstance(act, dict) and not act["in_collective"] and act["idle_s"] > limit
        ]
        for rec in stuck:
            logger.warning(
                "worker %s made no collective call for over %g s while the others timed out; killing it",
                rec.worker_id,
                limit,
            )
            self._kill(rec, failed=True)
        if stuck:
            return
        now = time.monotonic()
        window = 3 * self.settings.worker.collective_timeout
        if self._last_timeout_reset is not None and now - self._last_timeout_reset < window:
            # the same ring broke again with everyone alive and busy in collectives: re-forming it
            # would repeat this forever, so stop with the reason instead
            self._fail(
                f"the ring timed out twice in a row (generations {self.generation - 1} and {self.generation}) "
                "with every worker alive and inside a collective: the ranks' collectives do not match, "
                f"most likely a deadlock in train_fn (last error, worker {worker_id}: {reason})"
            )
            return
        self._last_timeout_reset = now
        self._unbound_events.append(self._event("reset_requested", f"worker {worker_id}: {reason}"))
        await self._maybe_publish(force=True)

    async def _watch_kv(self) -> None:
        """The KV actor cannot be replaced mid-run (the rings' keys live there): its death ends the run."""
        try:
            await self.kv.hold.remote()
        except Exception as e:  # noqa: BLE001 - ActorDiedError and kin
            self._queue.put_nowait(
                ("fatal", f"the run's rendezvous (KV) actor died ({_first_line(e)}); workers cannot form rings")
            )

    async def _liveness_loop(self) -> None:
        interval = max(0.2, self.settings.liveness_timeout / 3)
        while True:
            await asyncio.sleep(interval)
            live = [r for r in self._live(*_ALIVE) if r.handle is not None]
            pings = [asyncio.wait_for(r.handle.ping.remote(), self.settings.liveness_timeout) for r in live]
            results = await asyncio.gather(*pings, return_exceptions=True)
            for rec, result in zip(live, results, strict=False):
                if not isinstance(result, BaseException):
                    rec.answered = True
                # a process still starting (runtime env, imports) is bounded by the boot deadline instead
                elif isinstance(result, asyncio.TimeoutError) and rec.status in _ALIVE and rec.answered:
                    logger.warning(
                        "worker %s on node %s did not answer within liveness_timeout=%g s; killing it",
                        rec.worker_id,
                        rec.host[:8],
                        self.settings.liveness_timeout,
                    )
                    self._kill(rec, failed=True)

    # ---- generations -------------------------------------------------
    async def _maybe_publish(self, force: bool = False) -> None:
        """Publish the next generation if membership changed and it may form now."""
        if self.state in (DriverState.DONE, DriverState.FAILED):
            return
        members = self._live(WorkerStatus.READY, WorkerStatus.MEMBER)
        current = set(self.plan)
        if not force and {r.worker_id for r in members} == current:
            return
        lost = any(self.workers[w].status not in _ALIVE for w in current)
        if current and not any(self.workers[w].status in _ALIVE for w in current):
            # nobody holds the trained state any more: only a durable checkpoint can carry the run on
            if not await self._checkpoint_exists():
                where = (
                    "no durable checkpoint was written yet"
                    if self.settings.worker.checkpoint_dir
                    else "configure checkpoint_dir to resume from a durable checkpoint"
                )
                self._fail(
                    f"all {len(current)} workers of generation {self.generation} failed; no survivor holds the "
                    f"training state, so the run cannot continue ({where})"
                )
                return
            self._unbound_events.append(
                self._event(
                    "restarted",
                    f"all {len(current)} workers of generation {self.generation} were lost; fresh workers resume "
                    f"from the durable checkpoint in {self.settings.worker.checkpoint_dir}",
                )
            )
            self.plan = {}
            current = set()
            lost = False
        leaving = any(self.workers[w].status is WorkerStatus.LEAVING for w in current)
        starting = self._live(WorkerStatus.STARTING)
        if starting and not (lost or leaving or force):
            return  # let every newcomer finish booting, then admit them together
        if len(members) < self.settings.min_workers:
            self._set_state(DriverState.WAITING)
            return
        await self._publish(members)

    async def _checkpoint_exists(self) -> bool:
        url = self.settings.worker.checkpoint_dir
        if url is None:
            return False
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(
                loop.run_in_executor(None, lambda: CheckpointStore(url).exists()), self.settings.discovery_timeout
            )
        except Exception as e:  # noqa: BLE001 - unreachable storage is the same as no checkpoint here
            logger.warning("cannot look for a checkpoint in %s: %s", url, e)
            return False

    async def _publish(self, members: list[WorkerRecord]) -> None:
        previous = [self.workers[w] for w in self.plan]
        old_size = len(self.plan)
        self.generation += 1
        self.plan = assign_ranks([LiveWorker(r.worker_id, r.host, r.seq) for r in members])
        await self.kv.publish.remote(self.generation, self.plan)
        for rec in members:
            rec.status = WorkerStatus.MEMBER
        for rec in previous:
            if rec.status in (WorkerStatus.MEMBER, WorkerStatus.LEAVING) and rec.handle is not None:
                rec.handle.notify.remote(self.generation)
        size = len(self.plan)
        now = time.time()
        metrics.world_size(self.run_id, size)
        if self.generation > 1:
            metrics.reset(self.run_id)
        if self.generation == 1:
            self._unbound_events.append(self._event("start", f"{size} workers"))
            self._unbound_events[-1].time = self._started_at
        else:
            self.resets += 1
            logger.info("generation %d: world size %d -> %d", self.generation, old_size, size)
        for ev in self._unbound_events:
            if ev.kind == "hosts_added":
                # the others' pause starts now; the boot before it cost them nothing
                ev.detail += f", admitted after booting {now - ev.time:.1f} s"
                ev.time = now
        if any(ev.kind != "reset_requested" for ev in self._unbound_events):
            self._last_timeout_reset = None  # the membership changed: a later timeout is a new story
        for ev in self._unbound_events:
            ev.generation = self.generation
            ev.previous_world_size = old_size
            ev.world_size = size
            self.events.append(ev)
        self._unbound_events = []
        self._syncing = set(self.plan)
        self._set_state(DriverState.RESETTING if self.generation > 1 else DriverState.RUNNING)
        limit = self.settings.reset_limit
        if limit is not None and self.resets > limit:
            self._fail(f"reset_limit={limit} reached: {self.resets} resets")

    def _event(self, kind: str, detail: str) -> Event:
        return Event(time=time.time(), kind=kind, world_size=len(self.plan), generation=self.generation, detail=detail)

    # ---- called by workers and the trainer -------------------------------
    async def worker_ready(self, worker_id: str) -> None:
        self._queue.put_nowait(("ready", worker_id))

    async def worker_synced(self, worker_id: str, generation: int, at: float) -> None:
        if generation != self.generation or worker_id not in self._syncing:
            return
        self._syncing.discard(worker_id)
        if self._syncing:
            return
        for ev in self.events:
            if ev.generation == generation and ev.reset_duration is None:
                ev.reset_duration = max(0.0, at - ev.time)
                if ev.kind != "start":
                    metrics.recovery(self.run_id, ev.reset_duration)
                    logger.info("%s; recovered in %.2f s, world size %d", ev.detail, ev.reset_duration, ev.world_size)
        if self.state is DriverState.RESETTING:
            self._set_state(DriverState.RUNNING)

    async def worker_resumed(self, worker_id: str, meta: dict[str, Any]) -> None:
        """Rank 0 loaded the durable checkpoint before its first sync."""
        age = time.time() - meta.get("written_at", time.time())
        ev = self._event(
            "resumed",
            f"worker {worker_id} (rank 0) loaded the durable checkpoint of commit {meta.get('commit')} "
            f"(written {age:.1f} s ago at world size {meta.get('world_size')})",
        )
        ev.reset_duration = 0.0
        self.events.append(ev)

    async def request_reset(self, worker_id: str, generation: int, reason: str) -> None:
        self._queue.put_nowait(("reset_request", worker_id, generation, reason))

    async def add_metrics(self, worker_id: str, batch: list[tuple[float, dict]]) -> None:
        self.metrics.extend(batch)
        if not batch:
            return
        # rank 0 reports once per step: its report rate over the last few seconds is the step rate
        recent = [t for t, _ in self.metrics[-_RATE_WINDOW_REPORTS:] if t >= batch[-1][0] - _RATE_WINDOW_S]
        if len(recent) >= 2 and recent[-1] > recent[0]:
            metrics.steps_per_second(self.run_id, (len(recent) - 1) / (recent[-1] - recent[0]))

    async def stop(self, reason: str = "stopped by the user") -> None:
        """Ask the loop to end (e.g. the user interrupted `fit()`)."""
        if self._queue is not None:
            self._queue.put_nowait(("stop", reason))

    async def status(self, metrics_since: int = 0) -> dict[str, Any]:
        """A snapshot for progress display: state, world size, new metrics and events."""
        return {
            "state": self.state.value,
            "generation": self.generation,
            "world_size": len(self.plan),
            "resets": self.resets,
            "metrics": self.metrics[metrics_since:],
            "num_metrics": len(self.metrics),
            "events": [e.to_dict() for e in self.events],
        }

    # ---- the end -------------------------------------------------------
    async def _cleanup(self) -> None:
        for rec in self.workers.values():
            if rec.handle is not None and rec.status is not WorkerStatus.GONE:
                try:
                    ray.kill(rec.handle, no_restart=True)
                except Exception:  # noqa: BLE001 - already dead
                    pass
            self._release(rec)
        if self._autoscale_requested:
            try:
                from ray.autoscaler.sdk import request_resources

                request_resources(bundles=[])
            except Exception:  # noqa: BLE001 - nothing to withdraw
                pass

    def _outcome(self) -> dict[str, Any]:
        return {
            "ok": self.state is DriverState.DONE,
            "error": self.failure,
            "value": self.return_value,
            "metrics": self.metrics,
            "events": [e.to_dict() for e in self.events],
            "resets": self.resets,
        }


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def create_driver_actor(
    run_id: str,
    namespace: str,
    kv: Any,
    payload: bytes,
    discovery: Callable | str | None,
    settings: DriverSettings,
    scheduling_strategy: Any = None,
) -> Any:
    """Start the run's driver actor, named `driver` in the run's namespace."""
    cls = ray.remote(num_cpus=0, max_restarts=0)(DriverActor)
    return cls.options(
        name="driver", namespace=namespace, max_concurrency=1000, scheduling_strategy=scheduling_strategy
    ).remote(run_id, namespace, kv, payload, discovery, settings)
