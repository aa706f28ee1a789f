"""Copying rank 0's tensors to every rank: `broadcast_tensors_` and Horovod's `broadcast_parameters`.

Tensors are coalesced per dtype (one flat broadcast each) through the
current ring's `broadcast_`, so a model of many small tensors costs a few
collectives, not one per tensor. `TorchState`'s sync and the user-facing
helper share it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ray_elastic.collective import group
from ray_elastic.collective.checked import root_rank_in


def broadcast_tensors_(tensors: Iterable[torch.Tensor], root_rank: int = 0) -> None:
    """Broadcast tensors in place from `root_rank`, one coalesced message per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    ring = group()  # every rank holds the same tensors here: the ring's own broadcast, no cross-rank check
    root_rank = root_rank_in(root_rank, ring.size)
    with torch.no_grad():
        for same_dtype in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same_dtype])
            ring.broadcast_(flat, root_rank)
            offset = 0
            for t in same_dtype:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """Copy `root_rank`'s tensors to every rank, in place.

    `params`: a module's `state_dict()`, `named_parameters()`, or any iterable
    of tensors or (name, tensor) pairs.
    """
    items = params.items() if hasattr(params, "items") else params
    tensors = [item[1] if isinstance(item, tuple) else item for item in items]
    broadcast_tensors_(tensors, root_rank)
