"""`torch.amp.GradScaler`: committed and rolled back without waiting for the device.

A GradScaler's `state_dict()` reads its scale and growth tracker with
`.item()`: on a GPU each read waits until every kernel queued so far has
run, and the CPU's lead over the GPU is lost. On the H200 bench (134M
parameters, AdamW, a GradScaler, a commit every 10 steps) the commits cost
3.6% per step and the checks between them 0.8%, and these two reads were
the only place a commit read a device tensor. So a commit keeps device
copies of the two tensors (queued on the current stream, as the other
commit copies are) and the factors, which are host numbers; a rollback
copies them back into the scaler's own tensors, in place. A state dict is
made only when one is needed: a durable checkpoint, a newcomer's sync.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ray_elastic.torch.state_dict_handler import StateDictHandler


class GradScalerHandler(StateDictHandler):
    """A GradScaler: its commit is tensor copies while it has tensors; a state dict (of host numbers) before."""

    value: torch.amp.GradScaler

    def __init__(self, value: torch.amp.GradScaler) -> None:
        self._copies: tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None = None
        self._dict: dict[str, Any] = {}
        super(StateDictHandler, self).__init__(value)  # not StateDictHandler's: its first copy reads state_dict()
        self.save()

    @property
    def _saved(self) -> dict[str, Any]:
        """The commit as `state_dict()` gives it (reading the copies waits for them: checkpoints and syncs only)."""
        if self._copies is not None:
            scale, tracker, factors = self._copies
            self._dict = {"scale": scale.item(), **factors, "_growth_tracker": int(tracker.item())}
            self._copies = None
        return self._dict

    @_saved.setter
    def _saved(self, state: dict[str, Any]) -> None:
        self._dict = state
        self._copies = None

    def save(self) -> None:
        scaler = self.value
        scale, tracker = scaler._scale, scaler._growth_tracker
        if not scaler.is_enabled() or scale is None or tracker is None:
            super().save()  # not scaling yet: its state dict holds host numbers only, and reads no tensor
            return
        factors = {
            "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(),
            "growth_interval": scaler.get_growth_interval(),
        }
        with torch.no_grad():
            self._copies = (scale.clone(), tracker.clone(), factors)

    def restore(self) -> None:
        scaler = self.value
        if self._copies is None or scaler._scale is None or scaler._growth_tracker is None:
            super().restore()
            return
        scale, tracker, factors = self._copies
        with torch.no_grad():
            scaler._scale.copy_(scale)  # the scaler's own tensors, in place: no wait, addresses kept
            scaler._growth_tracker.copy_(tracker)
        scaler.set_growth_factor(factors["growth_factor"])
        scaler.set_backoff_factor(factors["backoff_factor"])
        scaler.set_growth_interval(factors["growth_interval"])
        # the rolled-back step's bookkeeping goes with it (see StateDictHandler.restore)
        scaler._per_optimizer_states.clear()

    def snapshot(self) -> Any:
        return copy.deepcopy(self._saved)
