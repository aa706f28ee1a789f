"""`ModuleHandler`: a `torch.nn.Module`'s parameters and buffers in a `TorchState`, by identity."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ray_elastic.torch.commit_buffers import TensorBuffers
from ray_elastic.torch.handler import StateHandler, _sync_from_rank0

if TYPE_CHECKING:
    import torch


class ModuleHandler(StateHandler):
    """A `torch.nn.Module`: its parameters and buffers, by identity."""

    def __init__(self, value: torch.nn.Module) -> None:
        super().__init__(value)
        self._saved = TensorBuffers()
        self._stepped: set[int] = set()

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.value.parameters()) + list(self.value.buffers())

    def _guarded(self, tensors: list[torch.Tensor]) -> list[bool]:
        return [id(t) in self._stepped for t in tensors]

    def guard(self, stepped: set[int]) -> None:
        self._stepped = stepped

    def save(self) -> None:
        self._saved.save(self._tensors())

    def restore(self) -> None:
        tensors = self._tensors()
        self._saved.restore(tensors, self._guarded(tensors))

    def touched(self) -> None:
        self._saved.touched()

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> None:
        return None

    def tensors(self) -> list[torch.Tensor]:
        return self._tensors()

    def keep_live(self) -> None:
        tensors = self._tensors()
        self._saved.save_later(tensors, self._guarded(tensors))

    def snapshot(self) -> list[torch.Tensor]:
        return self._saved.copies()

    def load_snapshot(self, snapshot: list[torch.Tensor]) -> None:
        tensors = self._tensors()
        shapes = [tuple(t.shape) for t in tensors]
        if [tuple(t.shape) for t in snapshot] != shapes:
            raise ValueError(
                f"the checkpoint's module has tensor shapes {[tuple(t.shape) for t in snapshot]}, "
                f"this model has {shapes}"
            )
        self._saved.wait()
        # read onto the host: each on its live tensor's device and dtype, as `Module.load_state_dict` copies it
        self._saved.buffers = [
            t.to(device=ref.device, dtype=ref.dtype) for t, ref in zip(snapshot, tensors, strict=True)
        ]
        self._saved.untouched = False
        self.restore()
