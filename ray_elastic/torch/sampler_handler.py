"""`SamplerHandler`: an `ElasticSampler`'s (or a prepared loader's) epoch and processed bitmap in a `TorchState`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ray_elastic.runtime.process import current
from ray_elastic.torch.handler import StateHandler, _sync_from_rank0
from ray_elastic.torch.sampler import ElasticSampler

if TYPE_CHECKING:
    from ray_elastic.runtime.context import WorkerContext


class SamplerHandler(StateHandler):
    """An `ElasticSampler` (or a prepared loader's): the epoch and the processed-sample bitmap.

    Args:
        value: the sampler, or a loader made by `prepare_data_loader`.
        worker: the runtime whose ring merges the ranks' bitmaps and sets
            the sampler's world after a sync (its `TorchState`'s); None
            outside a worker, where a commit merges nothing.
    """

    def __init__(self, value: Any, worker: WorkerContext | None = None) -> None:
        super().__init__(value)
        self._worker = worker
        self._saved = self.sampler.state_dict()

    @property
    def sampler(self) -> ElasticSampler:
        """The sampler itself, or the one inside a `prepare_data_loader` loader (the state's value)."""
        return self.value if isinstance(self.value, ElasticSampler) else self.value.sampler

    def prepare_save(self) -> None:
        # record_indices() marks only this rank's samples: OR the bitmaps so every rank holds all.
        # Agree first, so no rank enters the union alone (TorchState's first commit skips this).
        self.sampler.record_pending()  # a prepared loader's batch trained since it was handed out
        now = None if self._worker is None else self._worker.generation_now()
        ring = None if now is None else now.ring
        if ring is not None and ring.max_int(int(self.sampler.needs_union)):
            ring.bitwise_or_(self.sampler.bitmap)
            self.sampler.needs_union = False

    def save(self) -> None:
        self._saved = self.sampler.state_dict()

    def restore(self) -> None:
        self.sampler.load_state_dict(self._saved)

    def snapshot(self) -> dict[str, Any]:
        return self._saved  # state_dict() copies the bitmap, and save() replaces the dict

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        n = self.sampler.state_dict()["n"]
        if snapshot.get("n") != n:
            raise ValueError(f"the checkpoint's sampler covers {snapshot.get('n')} samples, this one {n}")
        self._saved = snapshot
        self.restore()

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in self.sampler.state_dict().items() if k != "bitmap"}

    def receive(self, meta: dict[str, Any]) -> None:
        state = self.sampler.state_dict()
        state.update(meta)
        if state["bitmap"].size != (meta["n"] + 7) // 8:
            state["bitmap"] = np.zeros((meta["n"] + 7) // 8, dtype=np.uint8)
        self.sampler.load_state_dict(state)

    def tensors(self) -> list[torch.Tensor]:
        return [torch.from_numpy(self.sampler.bitmap)]  # the live bitmap: received in place

    def after_sync(self) -> None:
        worker = self._worker if self._worker is not None else current()  # a sync runs inside a worker
        ring = worker.joined().ring
        self.sampler.set_world(ring.rank, ring.size)
