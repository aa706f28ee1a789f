"""The runtime of one worker process: its place in the ring and its notices.

Each worker actor holds one `WorkerContext` (a process-wide singleton, since
one actor is one process). It

- joins: tells the driver it is ready, then waits in the KV actor for a
  generation that includes it and builds that generation's ring;
- resets: tears the ring down and joins the next generation, or learns that
  it was removed (`WorkerRemovedError`);
- keeps the latest host-change notice the driver pushed into its memory, so
  `check_host_updates()` reads a field instead of polling anyone;
- buffers rank 0's `report()` metrics and ships them from a background thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import ray

from ray_elastic import metrics
from ray_elastic.assignment import WorkerSlot
from ray_elastic.checkpoint import CheckpointStore, CheckpointWriter
from ray_elastic.collective.base import CollectiveGroup
from ray_elastic.config import WorkerConfig
from ray_elastic.exceptions import (
    GenerationSupersededError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RendezvousTimeoutError,
    WorkerRemovedError,
)
from ray_elastic.rendezvous import KVClient

logger = logging.getLogger(__name__)

_METRICS_FLUSH_S = 0.25


def load_backend(backend: str) -> None:
    """Import the backend's libraries (torch: seconds in a fresh process) and check this worker can run it.

    A newcomer does this before it says it is ready, so the ring never waits
    for a member's imports.
    """
    if backend == "gloo":
        import ray_elastic.collective.torch_gloo  # noqa: F401
    elif backend == "pygloo":
        try:
            import ray_elastic.collective.pygloo_backend  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                f"backend 'pygloo' cannot be imported in this worker ({e}); pygloo has wheels up to Python 3.10: "
                "pip install 'ray-elastic[pygloo]'"
            ) from e
    elif backend == "nccl":
        from ray_elastic.collective import nccl

        nccl.load()
    else:
        raise ValueError(f"unknown backend {backend!r}")


def make_group(
    backend: str, kv: KVClient, generation: int, rank: int, size: int, timeout: float, local_rank: int = 0
) -> CollectiveGroup:
    """Build the ring for `generation` with the chosen backend (`local_rank` picks an NCCL worker's GPU)."""
    if backend == "gloo":
        from ray_elastic.collective.torch_gloo import TorchGlooGroup
        from ray_elastic.rendezvous import torch_store

        return TorchGlooGroup(torch_store(kv, generation, timeout, size), rank, size, timeout)
    if backend == "pygloo":
        from ray_elastic.collective.pygloo_backend import PyglooGroup

        return PyglooGroup(kv, generation, rank, size, timeout)
    if backend == "nccl":
        from ray_elastic.collective.nccl import TorchNcclGroup
        from ray_elastic.rendezvous import torch_store

        # no one-call family reads: NCCL's unique id is one key `<prefix>/0` that only rank 0 writes,
        # which the family read (made for Gloo's every-rank addresses) would wait on with N-1 keys missing
        return TorchNcclGroup(torch_store(kv, generation, timeout), rank, size, timeout, local_rank)
    raise ValueError(f"unknown backend {backend!r}")


class WorkerContext:
    """Rank, size, ring and notices of this worker process."""

    def __init__(
        self,
        worker_id: str,
        kv: ray.actor.ActorHandle,
        driver: ray.actor.ActorHandle,
        settings: WorkerConfig,
    ) -> None:
        self.worker_id = worker_id
        self.kv = KVClient(kv)
        self.driver = driver
        self.settings = settings
        self.run_id = settings.run_id
        self.generation = 0
        self.slot: WorkerSlot | None = None
        self.group: CollectiveGroup | None = None
        self.notice = 0  # newest generation the driver announced to this worker
        # when this worker last started or finished a collective, and whether it is inside one now:
        # a member that shows no activity while the others time out is stuck in user code
        self.last_activity = time.time()
        self.in_collective = False
        self._agreed: tuple[int, bool] | None = None  # (generation, any notice) from the last gradient allreduce
        self._announced = False
        # test seam: called with a point's name ("rendezvous") so fault-injection tests can fail a rank there
        self.fault_hook: Callable[[str], None] | None = None
        self._synced_generation = 0
        self._checkpoints: CheckpointWriter | None = None
        if settings.checkpoint_dir is not None:
            self._checkpoints = CheckpointWriter(CheckpointStore(settings.checkpoint_dir))
        self._commits = 0
        self._resume_checked = False
        self._metrics: deque[tuple[float, dict[str, Any]]] = deque()
        self._metrics_lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="ray-elastic-metrics", daemon=True)
        self._flusher.start()

    # ---- membership ------------------------------------------------------
    def ensure_joined(self) -> None:
        if self.group is None:
            self._join()

    def _join(self) -> None:
        if not self._announced:
            load_backend(self.settings.backend)
            self.driver.worker_ready.remote(self.worker_id)
            self._announced = True
        deadline = time.monotonic() + self.settings.rendezvous_timeout
        after = self.generation
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"worker {self.worker_id} found no generation to join within "
                    f"{self.settings.rendezvous_timeout:g} s (last generation {self.generation})"
                )
            generation, plan = self.kv.wait_generation(after, remaining, self.worker_id)
            slot = plan.get(self.worker_id)
            if slot is None:
                if self.slot is not None:
                    raise WorkerRemovedError(f"worker {self.worker_id} is not part of generation {generation}")
                after = generation  # a newcomer not yet admitted: wait for the next one
                continue
            if self.fault_hook is not None:
                self.fault_hook("rendezvous")
            try:
                self.group = make_group(
                    self.settings.backend,
                    self.kv,
                    generation,
                    slot.rank,
                    slot.size,
                    self.settings.collective_timeout,
                    local_rank=slot.local_rank,
                )
            except (HorovodInternalError, GenerationSupersededError, RendezvousTimeoutError) as e:
                # a peer died while the ring formed: the driver publishes a newer generation
                logger.info(
                    "worker %s: ring of generation %d did not form (%s); waiting for the next",
                    self.worker_id,
                    generation,
                    e,
                )
                self.driver.request_reset.remote(self.worker_id, generation, str(e))
                after = generation
                continue
            self.generation = generation
            self.slot = slot
            return

    def reset(self, failed: bool) -> None:
        """Leave the current ring and join the next generation."""
        if failed:
            self.driver.request_reset.remote(self.worker_id, self.generation, "collective failed")
        self.close_group()
        self._join()

    def close_group(self) -> None:
        self._agreed = None
        if self.group is not None:
            self.group.close()
            self.group = None

    def notify(self, generation: int) -> None:
        """Called by the driver (on a control thread): a new generation awaits."""
        if generation > self.notice:
            self.notice = generation

    def agree_on_notice(self, pending: bool) -> None:
        """A collective all ranks ran (the gradient allreduce) told whether any rank holds a notice."""
        self._agreed = (self.generation, pending)

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every rank at once if the world changed.

        Uses the agreement carried by the last gradient allreduce when there is
        one not yet consumed (every rank has the same), else one tiny max-allreduce.
        """
        self.ensure_joined()
        agreed, self._agreed = self._agreed, None
        if agreed is not None and agreed[0] == self.generation:
            pending = agreed[1]
        else:
            pending = self.group.max_int(self.notice) > self.generation
        if pending:
            raise HostsUpdatedInterrupt(skip_sync=False)

    # ---- durable checkpoints ----------------------------------------------
    def after_commit(self, state: Any, save_seconds: float) -> None:
        """Record the commit's cost; rank 0 hands every `checkpoint_every`-th commit to the checkpoint writer."""
        metrics.commit(self.run_id, save_seconds)
        if self._checkpoints is None or self.slot is None:
            return
        self._commits += 1
        if self.slot.rank != 0 or self._commits % self.settings.checkpoint_every:
            return
        meta = {"commit": self._commits, "generation": self.generation, "world_size": self.slot.size}
        self._checkpoints.submit(state.checkpoint_payload(), meta, timeout=self.settings.collective_timeout)

    def maybe_resume(self, state: Any) -> None:
        """Before a sync: a rank 0 that never synced loads the durable checkpoint, if there is one.

        Rank 0 is the oldest worker, so a rank 0 that never synced means no
        worker holds trained state: a new `fit()`, or every worker was lost.
        """
        if self._checkpoints is None or self._resume_checked or self._synced_generation or self.slot is None:
            return
        if self.slot.rank != 0:
            return
        self._resume_checked = True
        found = self._checkpoints.store.read()
        if found is None:
            return
        payload, meta = found
        state.load_checkpoint(payload)
        logger.info(
            "worker %s resumed from the checkpoint in %s: %s", self.worker_id, self.settings.checkpoint_dir, meta
        )
        self.driver.worker_resumed.remote(self.worker_id, meta)

    def flush_checkpoint(self) -> None:
        """Wait for the last checkpoint write (rank 0, before it returns)."""
        if self._checkpoints is not None:
            self._checkpoints.flush(self.settings.collective_timeout)

    def mark_synced(self) -> None:
        """Tell the driver (once per generation) that this rank finished its sync."""
        if self._synced_generation != self.generation:
            self._synced_generation = self.generation
            self.driver.worker_synced.remote(self.worker_id, self.generation, time.time())

    # ---- metrics ---------------------------------------------------------
    def report(self, metrics: dict[str, Any]) -> None:
        if self.slot is None or self.slot.rank != 0:
            return
        with self._metrics_lock:
            self._metrics.append((time.time(), dict(metrics)))

    def _drain(self) -> list[tuple[float, dict[str, Any]]]:
        with self._metrics_lock:
            batch = list(self._metrics)
            self._metrics.clear()
        return batch

    def _flush_loop(self) -> None:
        while not self._stop.wait(_METRICS_FLUSH_S):
            batch = self._drain()
            if batch:
                self.driver.add_metrics.remote(self.worker_id, batch)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the flusher and deliver the last metrics before the worker returns."""
        self._stop.set()
        self._flusher.join(timeout)
        batch = self._drain()
        if batch:
            ray.get(self.driver.add_metrics.remote(self.worker_id, batch), timeout=timeout)
        self.close_group()


_current: WorkerContext | None = None


def collective_activity(inside: bool) -> None:
    """Backends call this entering (True) and leaving (False) a blocking collective."""
    ctx = _current
    if ctx is not None:
        ctx.in_collective = inside
        ctx.last_activity = time.time()


def set_current(ctx: WorkerContext | None) -> None:
    global _current
    _current = ctx


def current() -> WorkerContext:
    """This process's context; a clear error outside an elastic worker."""
    if _current is None:
        raise RuntimeError("this ray_elastic function only works inside train_fn running under ElasticTrainer.fit()")
    return _current


def maybe_current() -> WorkerContext | None:
    return _current
