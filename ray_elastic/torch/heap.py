"""Heap warming: memory a newcomer touches before it says it is ready, so its first steps fault in nothing.

`faulted_in` allocates a CPU tensor whose pages are already resident (the
buffers a commit or a sync fills); `warm_heap` faults in and frees blocks
the size of the gradients, which the allocator keeps for the first backward
where it is tuned to (`runtime/allocator.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ray_elastic.runtime.allocator import is_tuned
from ray_elastic.state.pages import can_populate, populate_range

if TYPE_CHECKING:
    from collections.abc import Iterable


def faulted_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose pages are already faulted in (zeroed where that is the only way)."""
    t = torch.empty(shape, dtype=dtype)
    if not (can_populate() and populate_range(t.data_ptr(), t.numel() * t.element_size())):
        t.zero_()
    return t


def warm_heap(like: Iterable[torch.Tensor]) -> int:
    """Fault in a block the size of each CPU tensor in `like` and free it; returns the bytes.

    Where the allocator keeps freed blocks (`allocator.is_tuned()`), they stay
    in this thread's heap, resident, and the gradients of the first backward
    run on this thread take them instead of faulting fresh pages in; elsewhere
    they would be unmapped at once, so nothing is done.
    """
    if not is_tuned():
        return 0
    blocks = [faulted_in(tuple(t.shape), t.dtype) for t in like if t.device.type == "cpu"]
    return sum(b.numel() * b.element_size() for b in blocks)
