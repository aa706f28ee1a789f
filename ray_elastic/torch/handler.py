"""`StateHandler`: how one kind of value in a `TorchState` is saved, restored and synced.

The base every handler takes after (the model's in `module_handler.py`, the
optimizer's in `optimizer_handler.py`, the sampler's in `sampler_handler.py`,
objects that save themselves in `state_dict_handler.py`, and plain values'
`ObjectHandler` here), and `_sync_from_rank0`, the full
broadcast from rank 0 that a handler without a finer sync uses. Its own
module so that handlers in other modules need not import `TorchState`'s.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from ray_elastic.runtime.ring_ops import group as current_ring
from ray_elastic.state.state import mismatch
from ray_elastic.state.sync_plan import SyncPlan
from ray_elastic.state.transfer import share_object
from ray_elastic.torch.broadcast import send_tensors_

if TYPE_CHECKING:
    import torch


class StateHandler:
    """How one kind of value is saved, restored and synced.

    `save`, `restore` and `sync` are the minimum. To move state only to the
    ranks that need it, also implement `describe`, `receive`, `tensors` and,
    where needed, `received` and `after_sync` (`save` must then make no
    collective call: only the receivers run it in a sync).
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank hold rank 0's value (every rank calls it)."""
        raise NotImplementedError

    def describe(self) -> Any:
        """On rank 0: a small picklable description of the saved value, for the ranks that receive it."""
        raise NotImplementedError

    def receive(self, description: Any) -> None:
        """On a receiving rank: take `description`, and shape `tensors()` like rank 0's."""

    def tensors(self) -> list[torch.Tensor]:
        """The live tensors a sync copies into the receivers, in the same order on every rank."""
        return []

    def received(self) -> None:
        """On a receiving rank, once its tensors arrived: make what it now holds its commit."""
        self.keep_live()

    def keep_live(self) -> None:
        """Make the live value the commit, where the next optimizer step waits for it (`save()` by default)."""
        self.save()

    def after_sync(self) -> None:
        """On every rank, after each sync (e.g. to take the new world size)."""

    def prepare_save(self) -> None:
        """Collectives a save needs, run by every rank before any handler saves (a failure then tears nothing)."""

    def touched(self) -> None:
        """The state's optimizer is about to step: the live tensors stop being the commit."""

    def guard(self, stepped: set[int]) -> None:
        """`stepped`: ids of the tensors the state's optimizers step (whose step waits for a pending copy)."""

    def snapshot(self) -> Any:
        """A picklable copy of what `save()` kept, for a durable checkpoint."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support durable checkpoints: implement snapshot() and load_snapshot()"
        )

    def load_snapshot(self, snapshot: Any) -> None:
        """Make `snapshot` the saved value and restore it."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support durable checkpoints: implement snapshot() and load_snapshot()"
        )


def _moves_only_what_is_needed(handler: StateHandler) -> bool:
    return type(handler).describe is not StateHandler.describe


def _sync_from_rank0(handler: StateHandler) -> None:
    """The full broadcast of `handler`'s value from rank 0 (its `sync()`, as Horovod's helpers do)."""
    ring = current_ring()
    plan = SyncPlan(ring.rank, (0,), tuple(range(1, ring.size)))
    description = share_object(ring, plan, handler.describe() if ring.rank == 0 else None)
    if plan.receives:
        handler.receive(description)
    send_tensors_(ring, plan, handler.tensors())
    if plan.receives:
        handler.received()
    handler.after_sync()


class CopiedHandler(StateHandler):
    """A handler whose commit is one picklable copy in `_saved`: it is the durable snapshot as it is."""

    _saved: Any

    def snapshot(self) -> Any:
        return self._saved  # save() replaces it with a fresh copy

    def load_snapshot(self, snapshot: Any) -> None:
        differ = mismatch(self._saved, snapshot)
        if differ is not None:
            raise ValueError(f"the checkpoint does not fit this attribute: {differ}")
        self._saved = snapshot
        self.restore()


class ObjectHandler(CopiedHandler):
    """Any picklable value: deep copies; a sync hands rank 0's to the ranks that need it."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved = copy.deepcopy(value)

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value)

    def restore(self) -> None:
        self.value = copy.deepcopy(self._saved)

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> Any:
        return self.value

    def receive(self, description: Any) -> None:
        self.value = description
