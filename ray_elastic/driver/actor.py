"""The driver actor: the asyncio shell around `DriverCore` that carries its actions out.

Everything that happens reaches one queue as a typed message (a worker
ready, exited or dead, a discovery result, a reset request, a liveness
round, a tick). The loop takes what is queued as one batch, hands it to the
core, and carries out the actions that come back:

- placement: one placement group (one bundle of `resources_per_worker`)
  pinned to its node, and one worker actor in it, per slot;
- deaths: Ray fails the pending `run()` call at once; the shell asks Ray
  once per batch whether the dead workers' nodes are still alive (deaths
  that arrive together join one reset);
- publishing a generation to the KV actor and notifying the old members;
- liveness: every worker is pinged each third of `liveness_timeout`; for
  those that did not answer in time, the CPU time of their process is read
  on their node, so the core can tell a member computing in a long call
  that holds the GIL from a hung one;
- queries that take time (the members' activity after a broken ring, the
  durable checkpoint's existence) run as tasks that answer with a message,
  so the loop never waits on them.

The driver survives its own death. Ray restarts the actor (`max_restarts`)
and sends it again the calls it had not answered (`max_task_retries`), among
them `fit()`'s `run()`. The workers and their placement groups are detached,
so they outlive it and train on. After every batch the driver writes its
core to a snapshot (`snapshot.py`) before it carries the batch's actions
out, and answers the workers' calls only once their message is in a
snapshot; a restarted driver loads it, finds its workers by name, watches
their `run()` again (a second call returns the first one's outcome), starts
the ones whose start was cut short, and asks again what may have been lost
(`DriverCore.restarted`). Workers orphaned by a driver dead for good (when
`fit()`'s caller dies, Ray kills the driver with it) remove the run's
actors and placement groups themselves (`worker_actor.py`).

Every await has a deadline: the KV actor's answers, the members' pings and
the CPU reading of a member that missed one (`progress.py`)
`liveness_timeout`, Ray's node table and the checkpoint lookup
`discovery_timeout`, placement `elastic_timeout`. The one await without a
deadline is a worker's `run()` call, which lasts as long as training; the
liveness pings bound it instead.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_elastic import autoscale, metrics
from ray_elastic.auth import Authed, RunToken, with_token_check
from ray_elastic.checkpoint import CheckpointStore
from ray_elastic.config import RunConfig
from ray_elastic.discovery import DiscoveryError, DiscoveryPoller, alive_ray_nodes, make_discovery
from ray_elastic.driver import messages as m
from ray_elastic.driver import snapshot
from ray_elastic.driver.core import DriverCore, WorkerStatus
from ray_elastic.driver.metrics_log import MetricsLog
from ray_elastic.driver.progress import start_probe
from ray_elastic.driver.replies import read_activity, read_pings
from ray_elastic.leftovers import (
    CONTROL_ACTORS,
    remove_run_actors,
    remove_run_placement_groups,
    run_placement_groups,
)
from ray_elastic.payload import unpack
from ray_elastic.protocol import DriverStatus, RunOutcome
from ray_elastic.worker_actor import actor_class

logger = logging.getLogger(__name__)

_TICK_S = 0.5
_KV_BACK_S = 60.0  # how long a restarting KV actor may take to answer again


class _NoAnswerError(Exception):
    """A restarted driver's bounded wait ran out; the message names what it waited for."""


async def _within(what: str, awaitable: Any) -> Any:
    """`awaitable`, within `_KV_BACK_S`; else `_NoAnswerError` saying the driver could not `what`."""
    try:
        return await asyncio.wait_for(awaitable, _KV_BACK_S)
    except asyncio.TimeoutError as e:
        raise _NoAnswerError(f"the run's driver could not {what} within {_KV_BACK_S:g} s; the run cannot go on") from e


_CHECKPOINT_RETRY_S = 2.0  # between looks at checkpoint storage that failed


class _Died:
    """A worker's `run()` failed; the loop adds whether its node is alive before the core sees it."""

    __slots__ = ("worker_id", "reason")

    def __init__(self, worker_id: str, reason: str) -> None:
        self.worker_id = worker_id
        self.reason = reason


class _Seqs:
    """The sequence numbers seen, as every number up to `floor` and the ones above it (a few at most)."""

    def __init__(self) -> None:
        self.floor = 0
        self.above: set[int] = set()

    def add(self, seq: int) -> bool:
        """Note `seq`; False if it was seen before."""
        if seq <= self.floor or seq in self.above:
            return False
        self.above.add(seq)
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.discard(self.floor)
        return True


class _Received(NamedTuple):
    """A message from a call; the call is answered once a snapshot holds it (`seq`)."""

    seq: int
    message: Any  # None: nothing for the core (add_metrics changed the metrics log)


class DriverActor:
    """Wrapped by `ray.remote` in `create_driver_actor`; methods run on one loop."""

    def __init__(self, run_id: str, namespace: str, config: RunConfig) -> None:
        """Plain values only, which Ray keeps with the actor for its restarts (`_load_start` finds the rest)."""
        self.run_id = run_id
        self.namespace = namespace
        self.kv: Any = None  # the run's KV actor, found by name (`_load_start`)
        self.config = config
        self.worker_config = config.worker(run_id)
        self._payload_ref: Any = None  # train_fn's payload in the object store, for the workers (`_load_start`)
        self._discovery_spec: Any = None
        self.core = DriverCore(config, wall_offset=time.time() - time.monotonic(), started_at=time.monotonic())
        self.metrics = MetricsLog(run_id)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._handles: dict[str, Any] = {}
        self._pgs: dict[str, PlacementGroup] = {}
        self._runs: dict[str, asyncio.Task] = {}
        self._pids: dict[str, int] = {}  # each worker's process id, asked with its first ping
        self._probes: dict[str, Any] = {}  # node -> its ProcessProbe, started when a worker there first misses a ping
        self._tasks: list[asyncio.Task] = []
        self._autoscale_requested = 0
        self._worker_cls = actor_class()
        self._self_handle: Any = None
        self._metric_seqs: dict[str, _Seqs] = {}  # per worker: the metrics batches taken
        self._received = 0  # calls' messages queued so far
        self._in_batch = 0  # the newest of them in the batch being applied
        self._durable = 0  # the newest of them a snapshot holds
        self._answers: list[tuple[int, asyncio.Future]] = []  # calls waiting for their message's snapshot
        self._snapshot: bytes | None = None
        self._core_blob: bytes | None = None  # the core as last pickled: reused while it has not changed
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
        # the handle workers call back on: carrying the run's token (`with_token_check` set it)
        self._self_handle = Authed(ray.get_runtime_context().current_actor, self._run_token)
        try:
            try:
                await self._load_start()
            except snapshot.StartError as e:  # forged, or gone with the run: nothing to start from
                self.core.fail(str(e))
            else:
                await self._loop()
        except _NoAnswerError as e:  # a restart's bounded wait on the GCS or the KV actor ran out: named
            self.core.fail(str(e))
        except Exception as e:  # noqa: BLE001 - a driver bug must still end the run with its reason
            logger.exception("driver failed")
            self.core.fail(f"internal error in the driver: {type(e).__name__}: {e}")
        finally:
            for task in self._tasks:
                task.cancel()
            self._started.set()
            self._answer_all()
            self._cleanup()
        first, unfetched = self.metrics.fetch(0)
        return RunOutcome(
            ok=self.core.failure is None,
            error=self.core.failure,
            value=self.core.return_value,
            metrics=unfetched,
            metrics_from=first,
            events=[e.to_dict() for e in self.core.events],
            resets=self.core.resets,
            checkpoint_error=self.core.checkpoint_error,
        )

    async def _load_start(self) -> None:
        """Find the run's KV actor by name, take train_fn's payload and the discovery spec from the GCS.

        None of them is a constructor argument: Ray would keep an actor handle
        or a large argument in the object store, under `fit()`'s process, and
        a restart would hang on it once it is lost. Each within `_KV_BACK_S`.
        """
        loop = asyncio.get_running_loop()
        try:
            kv = await _within(
                "find the run's KV actor by name", loop.run_in_executor(None, ray.get_actor, "kv", self.namespace)
            )
        except ValueError as e:
            raise snapshot.StartMissingError(f"the run's KV actor is gone ({e}): the run ended") from e
        self.kv = Authed(kv, self._run_token)
        payload, discovery = await _within(
            "read train_fn's payload and the discovery spec from the GCS",
            loop.run_in_executor(None, snapshot.load_start, self.run_id, self._run_token),
        )
        self._payload_ref = ray.put(payload)
        # callables arrive pickled by the trainer (their module may exist only on its side)
        self._discovery_spec = unpack(discovery) if isinstance(discovery, bytes) else discovery

    async def _loop(self) -> None:
        """Start or resume the run, then apply what happens, batch by batch, until it ends."""
        resumed = _restarted()
        poller = make_poller(self._discovery_spec, self.config, resumed)
        if resumed:
            actions = await self._resume()
        else:
            try:
                first = [m.HostsDiscovered(await self._poll(poller))]
            except DiscoveryError as e:
                first = [m.DiscoveryFailed(str(e))]
            actions = self.core.handle(first, time.monotonic())
            await self._persist()
        self._started.set()
        await self._carry_out(actions)
        if not self.core.state.is_final:
            self._tasks.append(asyncio.create_task(self._discovery_loop(poller)))
            self._tasks.append(asyncio.create_task(self._liveness_loop()))
            self._tasks.append(asyncio.create_task(self._watch_kv()))
            self._tasks.append(asyncio.create_task(self._renew_autoscale_share()))
            self._tasks.append(asyncio.create_task(self._drain_loop()))
        last_tick = time.monotonic()
        while not self.core.state.is_final:
            batch = await self._next_batch()
            now = time.monotonic()
            if now - last_tick >= _TICK_S:
                batch.append(m.Tick())
                last_tick = now
            actions = self.core.handle(batch, now)
            # a tick that asked for nothing changed nothing a restarted driver needs (it prunes, it forgets)
            changed = bool(actions) or any(not isinstance(x, m.Tick) for x in batch)
            await self._persist(
                core_changed=changed
            )  # before the actions: a restarted driver asks again what they may have lost
            await self._carry_out(actions)

    async def _next_batch(self) -> list[m.Message]:
        """What is queued now (waiting up to a tick for the first), with deaths completed by their node's fate."""
        try:
            raw = [await asyncio.wait_for(self._queue.get(), _TICK_S)]
        except asyncio.TimeoutError:
            return []
        raw.extend(self._drain())
        if not any(isinstance(x, _Died) for x in raw):
            return self._unwrap(raw)
        # one query of Ray's node table for every death of this batch; deaths queued meanwhile
        # (a node's workers die together) join the batch
        alive = await self._alive_nodes()
        raw.extend(self._drain())
        raw = self._unwrap(raw)
        return [
            m.WorkerDied(x.worker_id, x.reason, alive is None or self._host_of(x.worker_id) in alive)
            if isinstance(x, _Died)
            else x
            for x in raw
        ]

    def _unwrap(self, raw: list[Any]) -> list[Any]:
        """The messages of `raw`; calls' messages are noted, to be answered once snapshotted."""
        out = []
        for x in raw:
            if isinstance(x, _Received):
                self._in_batch = max(self._in_batch, x.seq)
                if x.message is not None:
                    out.append(x.message)
            else:
                out.append(x)
        return out

    # ---- the snapshot ------------------------------------------------------------------
    async def _persist(self, core_changed: bool = True) -> None:
        """Write what a restarted driver needs (if it changed), then answer the calls it now holds.

        Pickled on the loop, so it is one moment's state: the core only when
        it changed (up to ~15 ms at the event log's cap), the metrics (a few
        reports) each time; a thread would not help, pickling holds the GIL.
        Written to the GCS off the loop, within `_KV_BACK_S`. A GCS that does
        not take it fails the run, naming why: a driver that cannot save
        cannot be resumed.
        """
        if core_changed or self._core_blob is None:
            self._core_blob = pickle.dumps(self.core, protocol=pickle.HIGHEST_PROTOCOL)
        blob = pickle.dumps((self._core_blob, self.metrics, self._metric_seqs), protocol=pickle.HIGHEST_PROTOCOL)
        durable = self._in_batch
        if blob != self._snapshot:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(
                    loop.run_in_executor(None, snapshot.save, self.run_id, blob, self._run_token), _KV_BACK_S
                )
            except Exception as e:  # noqa: BLE001 - a GCS that is down or slow: the run cannot be made durable
                why = f"no answer within {_KV_BACK_S:g} s" if isinstance(e, asyncio.TimeoutError) else _first_line(e)
                self.core.fail(f"the GCS did not take the driver's snapshot ({why}); the run cannot survive a restart")
                return
            self._snapshot = blob
        self._durable = durable
        waiting, self._answers = self._answers, []
        for seq, fut in waiting:
            if seq <= self._durable:
                if not fut.done():
                    fut.set_result(None)
            else:
                self._answers.append((seq, fut))

    def _answer_all(self) -> None:
        """The run ended: nothing more will be snapshotted; answer every call still waiting."""
        for _, fut in self._answers:
            if not fut.done():
                fut.set_result(None)
        self._answers = []

    async def _take(self, message: m.Message | None) -> None:
        """Queue a call's message; return once a snapshot holds it.

        A driver that dies first leaves the call unanswered: Ray sends it again to the restarted one.
        """
        self._driving()
        if self.core.state.is_final:
            return
        self._received += 1
        fut = asyncio.get_running_loop().create_future()
        self._answers.append((self._received, fut))
        self._queue.put_nowait(_Received(self._received, message))
        await fut

    async def _resume(self) -> list[m.Action]:
        """Ray restarted this driver: load the snapshot, find the workers, and say what to ask again."""
        loop = asyncio.get_running_loop()
        try:
            saved = await _within(
                "load its snapshot from the GCS",
                loop.run_in_executor(None, snapshot.load, self.run_id, self._run_token),
            )
        except snapshot.ForgedSnapshotError as e:
            self.core.fail(str(e))
            return []
        if saved is None:
            self.core.fail("the run's driver actor restarted before it had saved any state; the run cannot go on")
            return []
        core_blob, self.metrics, self._metric_seqs = saved
        self.core = pickle.loads(core_blob)  # covered by the snapshot's signature
        logger.warning("the driver restarted: resuming generation %d from its snapshot", self.core.generation)
        # a KV actor that restarted while no driver watched it holds no generation: the core learns of it
        # (an older, non-zero one only means the dead driver's publish was cut short: restored below)
        kv_generation = await _within("ask the KV actor its generation", self.kv.current_generation.remote())
        if self.core.generation and kv_generation == 0:
            self._queue.put_nowait(m.KVRestarted("it restarted while the driver was down"))
        actions = self.core.restarted(time.monotonic(), "its process died; Ray restarted it")
        await self._persist()
        await _within("find its workers again", self._reattach())
        return actions

    async def _reattach(self) -> None:
        """Find the core's live workers: watch their `run()` again, start the ones cut short, remove the rest."""
        loop = asyncio.get_running_loop()
        pgs = await loop.run_in_executor(None, run_placement_groups, self.namespace)
        alive = set(self.core.alive_ids())
        for worker_id in sorted(alive):
            rec = self.core.workers[worker_id]
            if worker_id in pgs:
                self._pgs[worker_id] = pgs[worker_id]
            try:
                handle = await loop.run_in_executor(None, ray.get_actor, worker_id, self.namespace)
            except ValueError:
                handle = None
            if handle is not None:
                self._handles[worker_id] = Authed(handle, self._run_token)
                self._runs[worker_id] = asyncio.create_task(self._watch(worker_id))
            elif rec.status is WorkerStatus.STARTING:  # its start was cut short: start it now (its group is kept)
                self._spawn(m.Spawn(worker_id, rec.host))
            else:
                self._queue.put_nowait(_Died(worker_id, "it was gone when the restarted driver looked for it"))
        # workers the dead driver was told to stop; the run's control actors (the feed too) stay
        keep = frozenset(alive)
        await loop.run_in_executor(None, lambda: remove_run_actors(self.namespace, keep | CONTROL_ACTORS))
        await loop.run_in_executor(None, lambda: remove_run_placement_groups(self.namespace, keep))
        for worker_id in self.core.plan:  # the notice of the current generation, if the dead driver had not sent it
            if worker_id in self._handles:
                self._handles[worker_id].notify.remote(self.core.generation)

    def _drain(self) -> list[Any]:
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items

    def _host_of(self, worker_id: str) -> str | None:
        rec = self.core.workers.get(worker_id)
        return rec.host if rec is not None else None

    async def _alive_nodes(self) -> set[str] | None:
        """The alive nodes' ids, or None if Ray's node table cannot be read (then every node counts as alive)."""
        loop = asyncio.get_running_loop()
        try:
            nodes = await asyncio.wait_for(loop.run_in_executor(None, alive_ray_nodes), self.config.discovery_timeout)
        except Exception as e:  # noqa: BLE001 - unknown: the hosts cool down as if their nodes were alive
            logger.warning("could not read Ray's node table within %g s: %s", self.config.discovery_timeout, e)
            return None
        return {n.node_id for n in nodes}

    # ---- carrying out actions --------------------------------------------------------
    async def _carry_out(self, actions: list[m.Action]) -> None:
        for action in actions:
            if isinstance(action, m.Spawn):
                self._spawn(action)
            elif isinstance(action, m.Kill):
                self._kill(action)
            elif isinstance(action, m.Release):
                self._release(action.worker_id)
            elif isinstance(action, m.Publish):
                await self._publish(action)
            elif isinstance(action, m.RestoreKV):
                await self._restore_kv(action)
            elif isinstance(action, m.Abandon):
                for worker_id in action.worker_ids:
                    handle = self._handles.get(worker_id)
                    if handle is not None:
                        handle.abandon.remote(action.generation, action.reason)
            elif isinstance(action, m.QueryActivity):
                self._background(self._query_activity(action))
            elif isinstance(action, m.LookForCheckpoint):
                self._background(self._look_for_checkpoint())
            elif isinstance(action, m.RequestResources):
                await self._request_resources(action.count)
            elif isinstance(action, m.RecordMetric):
                _RECORDERS[action.name](self.run_id, action.value)
            else:
                raise TypeError(f"the driver shell got an unknown action {action!r}")

    def _background(self, coro: Any) -> None:
        """Run `coro` beside the loop (cancelled when the run ends); the finished ones are let go."""
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(asyncio.create_task(coro))

    def _spawn(self, action: m.Spawn) -> None:
        if action.worker_id not in self._pgs:  # a restarted driver keeps the one its predecessor made
            # detached, as the worker: both outlive a driver that Ray restarts (the run removes them by name)
            self._pgs[action.worker_id] = placement_group(
                [dict(self.config.resources_per_worker)],
                strategy="STRICT_PACK",
                name=f"{self.namespace}-{action.worker_id}",
                lifetime="detached",
                bundle_label_selector=[{"ray.io/node-id": action.host}],
            )
        self._runs[action.worker_id] = asyncio.create_task(self._run_worker(action.worker_id))

    async def _run_worker(self, worker_id: str) -> None:
        pg = self._pgs[worker_id]
        try:
            await asyncio.wait_for(pg.ready(), self.config.elastic_timeout)
        except asyncio.TimeoutError:
            self._queue.put_nowait(_Died(worker_id, "its placement group was not placed in time"))
            return
        res = dict(self.config.resources_per_worker)
        try:
            handle = self._worker_cls.options(
                name=worker_id,
                namespace=self.namespace,
                num_cpus=res.pop("CPU", 0),
                num_gpus=res.pop("GPU", 0),
                memory=res.pop("memory", None),
                resources=res or None,
                lifetime="detached",
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(self._run_token, worker_id, self.kv, self._self_handle, self.worker_config)
        except Exception as e:  # noqa: BLE001 - Ray refused the actor's options: say so now, not after a timeout
            self._queue.put_nowait(m.WorkerStartFailed(worker_id, f"{type(e).__name__}: {_first_line(e)}"))
            return
        self._handles[worker_id] = Authed(handle, self._run_token)
        await self._watch(worker_id)

    async def _watch(self, worker_id: str) -> None:
        """Start the worker's training, or, for a restarted driver, wait for the one it runs: its outcome."""
        handle = self._handles[worker_id]
        try:
            # no deadline: this call lasts as long as training; the liveness pings bound a hang
            outcome = await handle.run.remote(self._payload_ref)
        except Exception as e:  # noqa: BLE001 - ActorDiedError and kin: the worker is gone
            self._queue.put_nowait(_Died(worker_id, f"{type(e).__name__}: {_first_line(e)}"))
        else:
            self._queue.put_nowait(m.WorkerExited(worker_id, outcome))

    def _kill(self, action: m.Kill) -> None:
        """Kill the worker and stop watching it: the core already counts it as gone (or dead, if `failed`)."""
        handle = self._handles.get(action.worker_id)
        if handle is not None:
            ray.kill(handle.handle, no_restart=True)
        task = self._runs.get(action.worker_id)
        if task is not None and not task.done():
            task.cancel()
        self._release(action.worker_id)

    def _release(self, worker_id: str) -> None:
        """The worker is gone: free its placement group and forget what the shell held for it."""
        self._handles.pop(worker_id, None)
        self._runs.pop(worker_id, None)
        self._pids.pop(worker_id, None)
        rec = self.core.workers.get(worker_id)
        if rec is None or rec.status is not WorkerStatus.FINISHED:  # rank 0's last batches may still be resent
            self._metric_seqs.pop(worker_id, None)
        pg = self._pgs.pop(worker_id, None)
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed
                pass

    async def _restore_kv(self, action: m.RestoreKV) -> None:
        try:
            await asyncio.wait_for(self.kv.restore.remote(action.generation, dict(action.plan)), _KV_BACK_S)
        except Exception as e:  # noqa: BLE001 - a timeout or a KV actor dead again
            why = f"no answer within {_KV_BACK_S:g} s" if isinstance(e, asyncio.TimeoutError) else _first_line(e)
            self._queue.put_nowait(m.PublishFailed(action.generation, f"restoring it failed: {why}"))

    async def _publish(self, action: m.Publish) -> None:
        try:
            await asyncio.wait_for(
                # a KV actor restarting meanwhile takes the call when it is back
                self.kv.publish.remote(action.generation, dict(action.plan)),
                _KV_BACK_S,
            )
        except Exception as e:  # noqa: BLE001 - a timeout or a dead KV actor: the run cannot form rings
            reason = f"no answer within {_KV_BACK_S:g} s" if isinstance(e, asyncio.TimeoutError) else _first_line(e)
            self._queue.put_nowait(m.PublishFailed(action.generation, reason))
            return
        for worker_id in action.notify:
            handle = self._handles.get(worker_id)
            if handle is not None:
                handle.notify.remote(action.generation)

    async def _query_activity(self, action: m.QueryActivity) -> None:
        """One query per member: its answer proves it alive and tells whether it is inside a collective."""
        ids = [w for w in action.worker_ids if w in self._handles]
        results = await asyncio.gather(
            *[asyncio.wait_for(self._handles[w].activity.remote(), self.config.liveness_timeout) for w in ids],
            return_exceptions=True,
        )
        activity = {w: read_activity(w, result) for w, result in zip(ids, results, strict=True)}
        self._queue.put_nowait(m.ActivityReport(action.generation, action.requester, action.reason, activity))

    async def _look_for_checkpoint(self) -> None:
        """Whether the durable checkpoint exists; storage that fails is asked again until `elastic_timeout`.

        Each look is bounded by `discovery_timeout`. Storage that still fails
        at the deadline is reported as such (`CheckpointFound.error`), never
        as a checkpoint that does not exist.
        """
        url = self.config.checkpoint_dir
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.config.elastic_timeout
        while True:
            try:
                exists = await asyncio.wait_for(
                    loop.run_in_executor(None, lambda: CheckpointStore(url).exists()), self.config.discovery_timeout
                )
            except Exception as e:  # noqa: BLE001 - storage errors of any kind: asked again, then reported
                why = (
                    f"no answer within {self.config.discovery_timeout:g} s"
                    if isinstance(e, asyncio.TimeoutError)
                    else f"{type(e).__name__}: {_first_line(e)}"
                )
                left = deadline - time.monotonic()
                if left <= 0:
                    self._queue.put_nowait(m.CheckpointFound(False, error=why))
                    return
                logger.warning("cannot look for a checkpoint in %s (%s); asking again", url, why)
                await asyncio.sleep(min(_CHECKPOINT_RETRY_S, left))
            else:
                self._queue.put_nowait(m.CheckpointFound(exists))
                return

    async def _request_resources(self, count: int) -> None:
        """Set this run's share of the autoscaler request (a cluster without an autoscaler simply does not grow)."""
        self._autoscale_requested = count
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(
                loop.run_in_executor(
                    None, autoscale.set_share, self.run_id, dict(self.config.resources_per_worker), count
                ),
                self.config.discovery_timeout,
            )
        except Exception as e:  # noqa: BLE001
            logger.warning("could not update the autoscaler request within %g s: %s", self.config.discovery_timeout, e)

    async def _renew_autoscale_share(self) -> None:
        """Keep this run's autoscaler share from expiring while it is wanted."""
        while True:
            await asyncio.sleep(autoscale.SHARE_TTL_S / 4)
            if self._autoscale_requested:
                await self._request_resources(self._autoscale_requested)

    # ---- background sources of messages -----------------------------------------------
    async def _poll(self, poller: DiscoveryPoller) -> dict[str, int] | None:
        # the poller bounds each call by discovery_timeout and applies the retry policy
        return await asyncio.get_running_loop().run_in_executor(None, poller.poll)

    async def _discovery_loop(self, poller: DiscoveryPoller) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval)
            try:
                hosts = await self._poll(poller)
            except DiscoveryError as e:
                self._queue.put_nowait(m.DiscoveryFailed(str(e)))
                return
            if hosts is not None:
                self._queue.put_nowait(m.HostsDiscovered(hosts))

    async def _drain_loop(self) -> None:
        """Ray's draining nodes (a preemption notice, `ray drain-node`), polled as often as discovery."""
        loop = asyncio.get_running_loop()
        last: dict[str, float] | None = None
        while True:
            try:
                raw = await asyncio.wait_for(
                    loop.run_in_executor(None, ray._private.state.state.get_draining_nodes),
                    self.config.discovery_timeout,
                )
            except Exception as e:  # noqa: BLE001 - a GCS hiccup: the next poll tries again
                logger.warning("could not read Ray's draining nodes: %s", e)
            else:
                draining = {node: deadline_ms / 1000 for node, deadline_ms in raw.items()}
                if draining != last:
                    self._queue.put_nowait(m.NodesDraining(draining))
                    last = draining
            await asyncio.sleep(self.config.discovery_interval)

    async def _liveness_loop(self) -> None:
        """Ping every live worker, and the probe of each node they run on, each round.

        A worker that did not answer in time is judged on its CPU time, read
        by its node's probe; when that probe did not answer the same round
        either, its node is unreachable (cut off, or lost without a word) and
        there is nothing to wait for. So a silent node costs at most one
        round: a third of `liveness_timeout` plus `liveness_timeout`.
        """
        interval = max(0.2, self.config.liveness_timeout / 3)
        while True:
            await asyncio.sleep(interval)
            ids = [w for w in self.core.alive_ids() if w in self._handles]
            nodes = sorted({h for w in ids if (h := self._host_of(w)) is not None})
            for node in set(self._probes) - set(nodes):  # no worker there any more (its node may be gone)
                self._kill_probe(node)
            for node in nodes:
                if node not in self._probes:
                    self._probes[node] = start_probe(node)
            sent_at = time.monotonic()
            timeout = self.config.liveness_timeout
            answers = await asyncio.gather(
                *[asyncio.wait_for(self._ping(w), timeout) for w in ids],
                *[asyncio.wait_for(self._probes[n].ping.remote(), timeout) for n in nodes],
                return_exceptions=True,
            )
            results = dict(zip(ids, answers[: len(ids)], strict=True))
            silent_nodes = set()
            for node, answer in zip(nodes, answers[len(ids) :], strict=True):
                if isinstance(answer, asyncio.TimeoutError):
                    silent_nodes.add(node)
                elif isinstance(answer, BaseException):  # the probe died: a fresh one reads CPU time if needed
                    self._kill_probe(node)
            answered, timed_out = read_pings(results)
            self._queue.put_nowait(
                m.PingResults(
                    answered=answered,
                    timed_out=timed_out,
                    sent_at=sent_at,
                    samples=await self._read_cpu(timed_out, silent_nodes) if timed_out else {},
                )
            )

    async def _ping(self, worker_id: str) -> None:
        """A ping; a worker's first asks for its pid instead (it answers the same way), to read its CPU time later."""
        handle = self._handles[worker_id]
        if worker_id in self._pids:
            await handle.ping.remote()
        else:
            self._pids[worker_id] = await handle.pid.remote()

    async def _read_cpu(self, worker_ids: frozenset[str], silent_nodes: set[str]) -> dict[str, m.CpuSample | str]:
        """Each worker's CPU use over a short window, read by its node's `ProcessProbe`, or why there is none.

        One call per node, under `liveness_timeout` in all (the probe's start
        included): a node cut off silently gives no reading, and its workers
        are then killed as hung.
        """
        window = min(0.5, self.config.liveness_timeout / 4)
        by_node: dict[str, list[str]] = {}
        samples: dict[str, m.CpuSample | str] = {}
        for worker_id in worker_ids:
            host = self._host_of(worker_id)
            if worker_id not in self._pids or host is None:
                samples[worker_id] = "its process id is not known yet"
            elif host in silent_nodes:
                samples[worker_id] = f"its node did not answer within {self.config.liveness_timeout:g} s either"
            else:
                by_node.setdefault(host, []).append(worker_id)

        async def read(node: str, ids: list[str]) -> None:
            if node not in self._probes:
                self._probes[node] = start_probe(node)
            try:
                by_pid = await asyncio.wait_for(
                    self._probes[node].sample.remote([self._pids[w] for w in ids], window),
                    self.config.liveness_timeout,
                )
            except Exception as e:  # noqa: BLE001 - no answer, or the probe died (with its node, maybe)
                if isinstance(e, asyncio.TimeoutError):
                    why = f"no reading within {self.config.liveness_timeout:g} s (its node may be unreachable)"
                else:
                    why = f"the reading failed: {_first_line(e)}"
                    self._kill_probe(node)  # the next reading starts a fresh one
                samples.update({w: why for w in ids})
                return
            samples.update({w: by_pid[self._pids[w]] for w in ids})

        await asyncio.gather(*[read(node, ids) for node, ids in by_node.items()])
        return samples

    def _kill_probe(self, node: str) -> None:
        probe = self._probes.pop(node, None)
        if probe is not None:
            try:
                ray.kill(probe, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass

    async def _watch_kv(self) -> None:
        """Learn of the KV actor's death at once (a `hold` call pending on it), and of its restart by Ray.

        A restarted KV actor is empty: the core has it told the current
        generation (`RestoreKV`). One it cannot reach again within
        `_KV_BACK_S` ends the run.
        """
        while True:
            try:
                await self.kv.hold.remote()  # no deadline: it answers only when the actor dies
            except Exception as e:  # noqa: BLE001 - ActorDiedError, ActorUnavailableError and kin
                reason = _first_line(e)
            try:
                await asyncio.wait_for(self.kv.current_generation.remote(), _KV_BACK_S)
            except Exception as e:  # noqa: BLE001 - gone for good, or not back in time
                why = "no answer" if isinstance(e, asyncio.TimeoutError) else _first_line(e)
                self._queue.put_nowait(m.KVLost(f"{reason}; not back within {_KV_BACK_S:g} s: {why}"))
                return
            logger.warning("the KV actor restarted (%s); restoring generation %d", reason, self.core.generation)
            self._queue.put_nowait(m.KVRestarted(reason))

    # ---- called by workers and the trainer --------------------------------------------
    # each answered once a snapshot holds it: a restarted driver gets again what its predecessor did not save
    async def worker_ready(self, worker_id: str) -> None:
        await self._take(m.WorkerReady(worker_id))

    async def worker_synced(self, worker_id: str, generation: int, at: float, commits: int | None = None) -> None:
        await self._take(m.WorkerSynced(worker_id, generation, at, commits))

    async def worker_resumed(self, worker_id: str, meta: dict[str, Any]) -> None:
        """Rank 0 loaded the durable checkpoint before its first sync."""
        await self._take(m.WorkerResumed(worker_id, meta))

    async def request_reset(self, worker_id: str, generation: int, reason: str) -> None:
        await self._take(m.ResetRequested(worker_id, generation, reason))

    async def add_metrics(self, worker_id: str, batch: list[tuple[float, dict]], seq: int | None = None) -> None:
        """Rank 0's reports; `seq` numbers the sender's batches, so one sent again after a restart counts once."""
        self._driving()
        await self._started.wait()
        if self.core.is_void(worker_id):  # declared dead (e.g. cut off, then healed): it no longer speaks for rank 0
            logger.info("dropped %d metric reports of worker %s, declared dead", len(batch), worker_id)
            return
        if seq is not None:
            if not self._metric_seqs.setdefault(worker_id, _Seqs()).add(seq):
                return  # taken and saved by this driver's predecessor
        self.metrics.add(batch)
        await self._take(None)

    async def stop(self, reason: str = "stopped by the user") -> None:
        """Ask the loop to end (e.g. the user interrupted `fit()`)."""
        self._queue.put_nowait(m.Stop(reason))

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
        )

    # ---- the end -----------------------------------------------------------------------
    def _cleanup(self) -> None:
        """Kill every worker still running, free every placement group, withdraw the autoscaler request."""
        for task in self._runs.values():
            task.cancel()
        for worker_id, handle in list(self._handles.items()):
            try:
                ray.kill(handle.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
            self._release(worker_id)
        for worker_id in list(self._pgs):
            self._release(worker_id)
        for node in list(self._probes):
            self._kill_probe(node)
        if self._autoscale_requested:
            autoscale.withdraw(self.run_id)


_RECORDERS: dict[str, Callable[[str, float], None]] = {
    "world_size": lambda run_id, value: metrics.world_size(run_id, int(value)),
    "reset": lambda run_id, value: metrics.reset(run_id),
    "recovery": metrics.recovery,
}


def make_poller(spec: Any, config: RunConfig, resumed: bool) -> DiscoveryPoller:
    """The run's discovery under its failure policy (`DiscoveryPoller`).

    A restarted driver (`resumed`) keeps its predecessor's view of the
    hosts: a discovery failure then is retried within `elastic_timeout`, as
    it was before the restart, instead of failing the run as a failure at
    the run's start does.
    """
    return DiscoveryPoller(
        make_discovery(
            spec,
            config.resources_per_worker,
            config.discovery_timeout,
            keep_cpus=config.kept_cpus,  # CPUs for Ray Data's tasks (datasets=, data_cpus)
        ),
        give_up_after=config.elastic_timeout,
        timeout=config.discovery_timeout,
        last_success=time.monotonic() if resumed else None,
    )


def _restarted() -> bool:
    """Whether Ray restarted this actor (what `was_current_actor_reconstructed` reads, without its warning)."""
    info = ray._private.state.actors(ray.get_runtime_context().get_actor_id())
    return bool(info) and info.get("NumRestarts", 0) != 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def create_driver_actor(
    run_id: str,
    namespace: str,
    token: RunToken,
    payload: bytes,
    discovery: Callable | str | None,
    config: RunConfig,
    scheduling_strategy: Any = None,
) -> Any:
    """Start the run's driver actor, named `driver` in the run's namespace; it answers only calls carrying `token`."""
    # restarted by Ray when it dies, and sent again the calls it had not answered (fit()'s run() among them)
    cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(with_token_check(DriverActor))
    # the payload and discovery wait in the GCS, signed, not in the object store under this process's ownership
    snapshot.save_start(run_id, token, payload, discovery)
    handle = cls.options(
        name="driver", namespace=namespace, max_concurrency=1000, scheduling_strategy=scheduling_strategy
    ).remote(token, run_id, namespace, config)
    return Authed(handle, token)
