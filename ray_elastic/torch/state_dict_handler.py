"""Objects that save and load themselves (`state_dict()`/`load_state_dict()`), restored in place.

LR schedulers, `GradScaler`, an EMA, a user's own class: the training loop
holds the object, and that object is the one that rolls back: a rollback
changes it in place and never replaces the attribute with a copy (a deep
copy of a scheduler drives a deep copy of the optimizer, and the real
optimizer's LR silently stops changing). A commit keeps a deep
copy of `state_dict()`; a restore hands a copy of it to `load_state_dict()`;
a newcomer receives rank 0's in the sync and loads it into the object its
own `train_fn` built.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ray_elastic.torch.handler import CopiedHandler, _sync_from_rank0


def saves_itself(value: Any) -> bool:
    """Whether `value` has callable `state_dict()` and `load_state_dict()` (and is not a class)."""
    return (
        not isinstance(value, type)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


class StateDictHandler(CopiedHandler):
    """An object with `state_dict()`/`load_state_dict()`: its state is committed, restored and synced in place."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved = copy.deepcopy(value.state_dict())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))
        if isinstance(self.value, torch.amp.GradScaler):
            # the rolled-back step's bookkeeping (optimizers unscaled or stepped before update()) goes with it,
            # or the redone step's unscale_ finds an optimizer "stepped" already
            self.value._per_optimizer_states.clear()

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> Any:
        return self.value.state_dict()

    def receive(self, description: Any) -> None:
        self.value.load_state_dict(copy.deepcopy(description))
