"""A torch.distributed process group over the run's KV actor: what Gloo and NCCL share.

The process group is created over a `Store` of one generation, destroyed on
reset and created again in the same process (tens of milliseconds). A backend
subclass says which torch backend it runs and on which device values must
live; `_stage` moves a caller's value there and back. numpy arrays go through
`torch.from_numpy`, which shares their memory, so on CPU in-place operations
write straight into the caller's array.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ray_elastic.collective.base import CollectiveGroup, CollectiveWork, ReduceOp, guarded_call

T = TypeVar("T")

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


def as_tensor(value: Any) -> torch.Tensor:
    """The caller's tensor, or a tensor sharing a numpy array's memory."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous or not value.flags.writeable:
            raise ValueError("numpy arrays passed to collectives must be C-contiguous and writeable")
        return torch.from_numpy(value)
    raise TypeError(f"collectives take torch tensors or numpy arrays, got {type(value).__name__}")


class TorchDistGroup(CollectiveGroup):
    """One generation's torch.distributed default process group."""

    backend = "abstract"

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: float, device: torch.device | None = None
    ) -> None:
        super().__init__(rank, size)
        self.device = device or torch.device("cpu")
        self._store = store  # torch calls back into this Python object: keep it alive with the group
        if not dist.is_initialized():
            # torch names the default group from a counter that only a successful destroy resets;
            # after a ring that failed to form, ranks would disagree on the name and never meet
            dist.distributed_c10d._world.group_count = 0
        self._call(
            "init_process_group",
            lambda: dist.init_process_group(
                self.backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
            ),
        )
        self._max_buf = torch.zeros(1, dtype=torch.int64, device=self.device)

    def _stage(self, value: Any) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """`value` as a tensor on this group's device, and how to copy a result back (None: shared)."""
        return as_tensor(value), None

    _call = staticmethod(guarded_call)

    def allreduce_(self, value: T, op: ReduceOp = ReduceOp.AVERAGE) -> T:
        t, write_back = self._stage(value)
        if t.numel() == 0 or self.size == 1:
            return value
        self._call("allreduce", lambda: dist.all_reduce(t, op=_TORCH_OPS[op]))
        self._finish_allreduce(t, op, write_back)
        return value

    def allreduce_async(self, value: T, op: ReduceOp = ReduceOp.AVERAGE) -> CollectiveWork:
        """torch's asynchronous allreduce: the ring works while the caller goes on (backward, for buckets)."""
        t, write_back = self._stage(value)
        if t.numel() == 0 or self.size == 1:
            return CollectiveWork()
        work = self._call("allreduce", lambda: dist.all_reduce(t, op=_TORCH_OPS[op], async_op=True))
        return CollectiveWork("allreduce", work.wait, lambda: self._finish_allreduce(t, op, write_back))

    def _finish_allreduce(self, t: torch.Tensor, op: ReduceOp, write_back: Callable[[], None] | None) -> None:
        """Turn the reduced sum into the op's result and hand it back to the caller's value."""
        if op is ReduceOp.AVERAGE:
            if t.is_floating_point() or t.is_complex():
                t.div_(self.size)
            else:
                t.floor_divide_(self.size)
        if write_back is not None:
            write_back()

    def broadcast_(self, value: T, root_rank: int = 0) -> T:
        t, write_back = self._stage(value)
        if t.numel() == 0 or self.size == 1:
            return value
        self._call("broadcast", lambda: dist.broadcast(t, src=root_rank))
        if write_back is not None:
            write_back()
        return value

    def allgather(self, value: T) -> T:
        t, _ = self._stage(value)
        if self.size == 1:
            out = t.clone() if t.dim() else t.reshape(1).clone()
        else:
            out = self._allgather(t)
        if isinstance(value, np.ndarray):
            return out.cpu().numpy()
        return out.to(value.device)

    def _allgather(self, t: torch.Tensor) -> torch.Tensor:
        lengths = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        lengths[self.rank] = t.shape[0] if t.dim() else 1
        self._call("allgather", lambda: dist.all_reduce(lengths, op=dist.ReduceOp.SUM))
        counts = lengths.tolist()
        flat = t.reshape(-1) if t.dim() else t.reshape(1)
        # elements per row from the shape, so a rank with zero rows pads like the others
        row = math.prod(t.shape[1:]) if t.dim() else 1
        longest = max(counts)
        padded = torch.zeros(longest * row, dtype=t.dtype, device=self.device)
        padded[: flat.numel()] = flat
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        if padded.numel():
            self._call("allgather", lambda: dist.all_gather(parts, padded))
        pieces = [p[: int(n) * row] for p, n in zip(parts, counts, strict=False)]
        return torch.cat(pieces).reshape(-1, *t.shape[1:]) if t.dim() else torch.cat(pieces)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        if self.size == 1:
            return obj
        box = [obj if self.rank == root_rank else None]
        self._call("broadcast_object", lambda: dist.broadcast_object_list(box, src=root_rank))
        return box[0]

    def allgather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        self._call("allgather_object", lambda: dist.all_gather_object(out, obj))
        return out

    def barrier(self) -> None:
        if self.size > 1:
            self._call("barrier", lambda: dist.barrier())

    def max_int(self, value: int) -> int:
        """Max of one integer over all ranks, on a buffer allocated once."""
        if self.size == 1:
            return value
        self._max_buf.fill_(value)
        self._call("check_host_updates", lambda: dist.all_reduce(self._max_buf, op=dist.ReduceOp.MAX))
        return int(self._max_buf.item())

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken ring may fail to tear down; it is dropped either way
                pass
