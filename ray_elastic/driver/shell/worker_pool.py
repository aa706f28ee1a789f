"""The run's worker actors and their placement groups: started, watched, killed, and found again.

One placement group (one bundle of `resources_per_worker`, pinned to its
node) and one worker actor in it per slot, both detached: they outlive a
driver that Ray restarts, and the run removes them by name when it ends.
Each worker's `run()` call is watched; its outcome or its death reaches the
driver's loop as a message. A restarted driver finds its workers again by
name (`reattach`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ray_elastic.auth import Authed, RunToken
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.roster import WorkerStatus
from ray_elastic.run_footprint import (
    CONTROL_ACTORS,
    remove_run_actors,
    remove_run_placement_groups,
    run_placement_groups,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ray_elastic.config import RunConfig

logger = logging.getLogger(__name__)


class Died:
    """A worker's `run()` failed; the loop adds whether its node is alive before the core sees it."""

    __slots__ = ("worker_id", "reason")

    def __init__(self, worker_id: str, reason: str) -> None:
        self.worker_id = worker_id
        self.reason = reason


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class WorkerPool:
    """Handles, placement groups, `run()` watchers and process ids of the run's workers.

    Args:
        namespace: the run's Ray namespace (workers and groups are named in it).
        config: the run's options (`resources_per_worker`, `elastic_timeout` for placement).
        token: the run's token; calls to the workers carry it.
        report: puts a message on the driver's queue (`Died`, `WorkerExited`, `WorkerStartFailed`).
        worker_cls: the worker's Ray actor class (`worker_actor.actor_class()`), given by the driver actor
            so that the driver's package does not import the worker's.
    """

    def __init__(
        self, namespace: str, config: RunConfig, token: RunToken, report: Callable[[Any], None], worker_cls: Any
    ) -> None:
        self.namespace = namespace
        self.config = config
        self.token = token
        self.report = report
        self.handles: dict[str, Any] = {}
        self.pgs: dict[str, PlacementGroup] = {}
        self.runs: dict[str, asyncio.Task] = {}
        self.pids: dict[str, int] = {}  # each worker's process id, asked with its first ping
        self._worker_cls = worker_cls
        self.start_args: tuple[Any, ...] = ()  # (kv, driver handle, worker config), set once the driver started
        self.payload_ref: Any = None  # train_fn's payload in the object store

    def spawn(self, worker_id: str, host: str, spare: bool = False) -> None:
        """Place a group for the worker on `host` and start it there (its outcome is reported when it ends).

        A hot spare (`spare`) is told so in its settings: it waits for a
        generation that admits it with no deadline of its own (the driver
        bounds its boot, the liveness rounds its hangs).
        """
        if worker_id not in self.pgs:  # a restarted driver keeps the one its predecessor made
            # detached, as the worker: both outlive a driver that Ray restarts (the run removes them by name)
            self.pgs[worker_id] = placement_group(
                [dict(self.config.resources_per_worker)],
                strategy="STRICT_PACK",
                name=f"{self.namespace}-{worker_id}",
                lifetime="detached",
                bundle_label_selector=[{"ray.io/node-id": host}],
            )
        self.runs[worker_id] = asyncio.create_task(self._run_worker(worker_id, host, spare))

    async def _run_worker(self, worker_id: str, host: str, spare: bool) -> None:
        pg = self.pgs[worker_id]
        limit = self.config.elastic_timeout
        try:
            await asyncio.wait_for(pg.ready(), limit)
        except asyncio.TimeoutError:
            asked = dict(self.config.resources_per_worker)
            self.report(
                Died(
                    worker_id,
                    f"its placement group ({asked} on node {host[:8]}) was not placed within "
                    f"elastic_timeout={limit:g} s",
                )
            )
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
            ).remote(self.token, worker_id, *self._args(spare))
        except Exception as e:  # noqa: BLE001 - Ray refused the actor's options: say so now, not after a timeout
            self.report(m.WorkerStartFailed(worker_id, f"{type(e).__name__}: {first_line(e)}"))
            return
        self.handles[worker_id] = Authed(handle, self.token)
        await self._watch(worker_id)

    def _args(self, spare: bool) -> tuple[Any, ...]:
        """The worker's start arguments: (kv, driver handle, worker config), the config marked for a spare."""
        if not spare:
            return self.start_args
        kv, driver, settings = self.start_args
        return kv, driver, dataclasses.replace(settings, spare=True)

    async def _watch(self, worker_id: str) -> None:
        """Start the worker's training, or, for a restarted driver, wait for the one it runs: its outcome."""
        handle = self.handles[worker_id]
        try:
            # no deadline: this call lasts as long as training; the liveness pings bound a hang
            outcome = await handle.run.remote(self.payload_ref)
        except Exception as e:  # noqa: BLE001 - ActorDiedError and kin: the worker is gone
            self.report(Died(worker_id, f"{type(e).__name__}: {first_line(e)}"))
        else:
            self.report(m.WorkerExited(worker_id, outcome))

    def kill(self, worker_id: str) -> None:
        """Kill the worker and stop watching it, then release it."""
        handle = self.handles.get(worker_id)
        if handle is not None:
            ray.kill(handle.handle, no_restart=True)
        task = self.runs.get(worker_id)
        if task is not None and not task.done():
            task.cancel()
        self.release(worker_id)

    def release(self, worker_id: str) -> None:
        """The worker is gone: free its placement group and forget what the pool held for it."""
        self.handles.pop(worker_id, None)
        self.runs.pop(worker_id, None)
        self.pids.pop(worker_id, None)
        pg = self.pgs.pop(worker_id, None)
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed
                pass

    def notify(self, worker_ids: Iterable[str], generation: int) -> None:
        """Tell these workers a new generation exists (fire and forget: a dead one is reported by its run())."""
        for worker_id in worker_ids:
            handle = self.handles.get(worker_id)
            if handle is not None:
                handle.notify.remote(generation)

    def abandon(self, action: m.Abandon) -> None:
        """Tell the members of a ring that lost one to abandon it now."""
        for worker_id in action.worker_ids:
            handle = self.handles.get(worker_id)
            if handle is not None:
                handle.abandon.remote(action.generation, action.reason)

    async def reattach(self, alive: dict[str, tuple[str, WorkerStatus]]) -> None:
        """Find the live workers of a restarted driver: watch their `run()` again, start the ones cut short.

        `alive`: worker id -> (host, its status in the core). The run's
        other actors and groups (workers the dead driver was told to stop)
        are removed; its control actors (the feed too) stay.
        """
        loop = asyncio.get_running_loop()
        pgs = await loop.run_in_executor(None, run_placement_groups, self.namespace)
        for worker_id in sorted(alive):
            host, status = alive[worker_id]
            if worker_id in pgs:
                self.pgs[worker_id] = pgs[worker_id]
            try:
                handle = await loop.run_in_executor(None, ray.get_actor, worker_id, self.namespace)
            except ValueError:
                handle = None
            if handle is not None:
                self.handles[worker_id] = Authed(handle, self.token)
                self.runs[worker_id] = asyncio.create_task(self._watch(worker_id))
            elif status in (WorkerStatus.STARTING, WorkerStatus.SPARE_BOOTING):  # its start was cut short: start it
                self.spawn(worker_id, host, spare=status is WorkerStatus.SPARE_BOOTING)  # now (its group is kept)
            else:
                self.report(Died(worker_id, "it was gone when the restarted driver looked for it"))
        keep = frozenset(alive)
        await loop.run_in_executor(None, lambda: remove_run_actors(self.namespace, keep | CONTROL_ACTORS))
        await loop.run_in_executor(None, lambda: remove_run_placement_groups(self.namespace, keep))

    def close(self) -> None:
        """Kill every worker still running and free every placement group."""
        for task in self.runs.values():
            task.cancel()
        for worker_id, handle in list(self.handles.items()):
            try:
                ray.kill(handle.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
            self.release(worker_id)
        for worker_id in list(self.pgs):
            self.release(worker_id)
