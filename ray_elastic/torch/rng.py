"""`RngState`: the random generators a training step draws from, committed and rolled back with the state.

Dropout masks, random augmentations and `torch.randperm` shuffles come from
torch's, numpy's and Python's global generators. Kept in a `TorchState`
(`TorchState(..., rng=True)` makes one), a rollback puts them back where
they were at the commit, so the redone steps draw what the undone ones drew.
A newcomer receives rank 0's generators in its sync (like every other
attribute); ranks that keep their commit keep their own.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RngState:
    """torch's (CPU and, where present, CUDA), numpy's and Python's global generator states."""

    def state_dict(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def __repr__(self) -> str:
        return "RngState()"
