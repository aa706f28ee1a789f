"""`State` and `ObjectState`: what survives a reset, with Horovod's semantics.

- `commit()` = `save()` + `check_host_updates()`: an in-memory snapshot that a
  failure rolls back to, and the point where graceful host changes surface.
- `restore()` returns to the last `save()`; `sync()` makes every rank hold
  rank 0's state (rank 0 is the oldest survivor, see `assignment.py`).
- Every save gives the state a new `CommitId`. `ObjectState` and
  `TorchState` sync by comparing ids first (one tiny allreduce): ranks that
  already hold rank 0's commit, as every survivor of a failure does, receive
  nothing; only the others (newcomers) get rank 0's values, point to point.
- Reset callbacks run after every reset, once the new ring exists, e.g. to
  rescale the learning rate with the new world size.

A state commits to, and syncs over, one worker's runtime (`WorkerContext`):
its commit count, checkpoint cadence and host-change notices, and the ring
of the generation it is in. The state is handed it at construction (by
default the process's: the one the worker actor made current), so the
dependency shows in the constructor instead of hiding in `commit()`.
"""

from __future__ import annotations

import copy
import numbers
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_elastic.checkpoint.entries import register_form
from ray_elastic.runtime.commits import CommitId, fresh_commit_id
from ray_elastic.runtime.process import current, maybe_current
from ray_elastic.state.transfer import agree, share_object

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ray_elastic.runtime.context import WorkerContext


@dataclass(frozen=True)
class SyncReport:
    """What one sync did: who held rank 0's commit, who received it, and this rank's share."""

    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    received_bytes: int  # tensor bytes this rank received (0 on a holder)
    seconds: float
    agreed_after: float = 0.0  # seconds until the ranks agreed on who holds it: mostly the wait for the last rank


class State:
    """Base class: subclasses implement `save`, `restore` and `sync`.

    Args:
        worker: the worker runtime this state commits to and syncs over;
            None (the default): this process's, found once, here (a state
            built outside a worker finds it at its first commit or sync).
    """

    def __init__(self, worker: WorkerContext | None = None) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self.commit_id: CommitId = fresh_commit_id()  # the commit this rank holds (see `ray_elastic.state.sync_plan`)
        self.last_sync: SyncReport | None = None
        self._worker = worker if worker is not None else maybe_current()

    def worker_context(self) -> WorkerContext:
        """The worker runtime this state commits to (a clear error outside an elastic worker)."""
        if self._worker is None:  # built before the worker's runtime existed (a script's top level): the process's
            self._worker = current()
        return self._worker

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Callables run, in order, after each reset (the new ring already works)."""
        callbacks = list(callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"reset callbacks must be callable, got {cb!r}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for cb in self._reset_callbacks:
            cb()

    def commit(self) -> None:
        """Save the state in memory, then check for host updates.

        With `checkpoint_dir` configured, rank 0 also hands every
        `checkpoint_every`-th commit to its background checkpoint writer.
        The commit is counted, and the hosts checked, on the state's worker
        (`worker_context()`).
        """
        worker = self.worker_context()
        started = time.perf_counter()
        self.save()
        worker.after_commit(self, time.perf_counter() - started)
        self.check_host_updates()  # a subclass may act on the interrupt (LightningState saves the live step)

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on all ranks at the same step if hosts changed.

        One tiny max-allreduce of the newest notice each rank holds, so all
        ranks agree even if the driver's notice reached them at different steps.
        """
        self.worker_context().check_host_updates()

    def save(self) -> None:
        raise NotImplementedError

    def keep_live(self) -> None:
        """Make the live state the commit, on a graceful reset (`save()` unless a subclass does it cheaper)."""
        self.save()

    def restore(self) -> None:
        raise NotImplementedError

    def restore_before_sync(self) -> None:
        """Back to the last commit where a sync follows at once (the run loop's reset): `restore()` unless cheaper.

        A state whose sync rewrites part of it from the commit anyway may
        leave that part for the sync to set (see `TorchState`).
        """
        self.restore()

    def sync(self) -> None:
        raise NotImplementedError

    def checkpoint_payload(self) -> Any:
        """A picklable copy of the last commit, for a durable checkpoint."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support durable checkpoints: "
            "implement checkpoint_payload() and load_checkpoint()"
        )

    def load_checkpoint(self, payload: Any) -> None:
        """Make `payload` (from `checkpoint_payload()`) the last commit, and restore it."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support durable checkpoints: "
            "implement checkpoint_payload() and load_checkpoint()"
        )


class ObjectState(State):
    """Picklable attributes, saved by deep copy; a sync sends them only to the ranks that lack rank 0's commit.

    `ObjectState(epoch=0, batch=0, weights=w)` exposes `state.epoch` and so
    on. Right for small state (counters, numpy arrays of modest size); large
    tensors belong in `TorchState`, which copies into reused buffers.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._keys = list(kwargs)
        for key, value in kwargs.items():
            setattr(self, key, value)
        self._saved: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        after = self.commit_id.next()
        self._saved = {k: copy.deepcopy(getattr(self, k)) for k in self._keys}
        self.commit_id = after

    def restore(self) -> None:
        for key, value in self._saved.items():
            setattr(self, key, copy.deepcopy(value))

    def sync(self) -> None:
        started = time.perf_counter()
        ring = self.worker_context().joined().ring
        plan = agree(ring, self.commit_id)
        agreed = time.perf_counter() - started
        shared = share_object(ring, plan, (self.commit_id, self._saved) if ring.rank == 0 else None)
        if plan.receives:
            self.commit_id, self._saved = shared
            self.restore()
        self.last_sync = SyncReport(plan.holders, plan.receivers, 0, time.perf_counter() - started, agreed)

    def checkpoint_payload(self) -> dict[str, Any]:
        return self._saved  # save() replaces the dict rather than mutating it

    def load_checkpoint(self, payload: dict[str, Any]) -> None:
        if not isinstance(payload, dict) or set(payload) != set(self._keys):
            held = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
            raise ValueError(
                f"the checkpoint does not fit this ObjectState: it holds {held}, this state holds "
                f"{sorted(self._keys)} (a checkpoint_dir of another experiment?)"
            )
        differ = [f"{k}: {d}" for k in self._keys if (d := mismatch(self._saved[k], payload[k])) is not None]
        if differ:
            raise ValueError(f"the checkpoint does not fit this ObjectState: {'; '.join(differ)}")
        self._saved = {k: payload[k] for k in self._keys}
        self.restore()
        self.commit_id = fresh_commit_id()  # a state no other rank holds: the sync hands it to them


# an ObjectState's checkpoint is its attributes, each an entry of its own
register_form(ObjectState, lambda state: dict(state.checkpoint_payload()), lambda state, e: state.load_checkpoint(e))


def mismatch(ours: Any, theirs: Any) -> str | None:
    """None if a checkpointed value `theirs` can stand for `ours`, else what differs.

    Compatible: either is None (an attribute not set yet), both numbers (an
    int counter saved as a float), one's type a subclass of the other's, and
    for arrays and tensors the same shape and dtype.
    """
    if ours is None or theirs is None:
        return None
    if isinstance(ours, numbers.Number) and isinstance(theirs, numbers.Number):
        return None
    if not (isinstance(theirs, type(ours)) or isinstance(ours, type(theirs))):
        return f"this state holds a {type(ours).__name__}, the checkpoint a {type(theirs).__name__}"
    shape, dtype = getattr(ours, "shape", None), getattr(ours, "dtype", None)
    if shape is not None and dtype is not None:
        if tuple(shape) != tuple(theirs.shape) or dtype != theirs.dtype:
            return (
                f"this state holds shape {tuple(shape)} {dtype}, "
                f"the checkpoint shape {tuple(theirs.shape)} {theirs.dtype}"
            )
    return None
