"""The torch.distributed Gloo backend, the default on CPU.

The process group is created over the run's KV actor (a `Store` per
generation), destroyed on reset and created again in the same process, which
takes tens of milliseconds. numpy arrays go through `torch.from_numpy`, which
shares their memory, so in-place operations write into the caller's array.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ray_elastic.collective.base import CollectiveGroup, ReduceOp
from ray_elastic.exceptions import HorovodInternalError
from ray_elastic.worker_context import collective_activity

T = TypeVar("T")

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous or not value.flags.writeable:
            raise ValueError("numpy arrays passed to collectives must be C-contiguous and writeable")
        return torch.from_numpy(value)
    raise TypeError(f"collectives take torch tensors or numpy arrays, got {type(value).__name__}")


class TorchGlooGroup(CollectiveGroup):
    """A torch.distributed Gloo process group for one generation."""

    name = "gloo"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: float) -> None:
        super().__init__(rank, size)
        self._store = store  # torch calls back into this Python object: keep it alive with the group
        if not dist.is_initialized():
            # torch names the default group from a counter that only a successful destroy resets;
            # after a ring that failed to form, ranks would disagree on the name and never meet
            dist.distributed_c10d._world.group_count = 0
        self._call(
            "init_process_group",
            lambda: dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
            ),
        )
        self._max_buf = torch.zeros(1, dtype=torch.int64)

    @staticmethod
    def _call(what: str, fn: Callable[[], T]) -> T:
        collective_activity(True)
        try:
            return fn()
        except HorovodInternalError:
            raise
        except (RuntimeError, ConnectionError, TimeoutError) as e:
            # DistBackendError, Gloo's "connection closed" and store errors all land here
            raise HorovodInternalError(f"{what} failed: {e}") from e
        finally:
            collective_activity(False)

    def allreduce_(self, value: T, op: ReduceOp = ReduceOp.AVERAGE) -> T:
        t = _as_tensor(value)
        if t.numel() == 0 or self.size == 1:
            return value
        self._call("allreduce", lambda: dist.all_reduce(t, op=_TORCH_OPS[op]))
        if op is ReduceOp.AVERAGE:
            if t.is_floating_point() or t.is_complex():
                t.div_(self.size)
            else:
                t.floor_divide_(self.size)
        return value

    def broadcast_(self, value: T, root_rank: int = 0) -> T:
        t = _as_tensor(value)
        if t.numel() == 0 or self.size == 1:
            return value
        self._call("broadcast", lambda: dist.broadcast(t, src=root_rank))
        return value

    def allgather(self, value: T) -> T:
        t = _as_tensor(value)
        if self.size == 1:
            out = t.clone() if t.dim() else t.reshape(1).clone()
            return out.numpy() if isinstance(value, np.ndarray) else out
        lengths = torch.zeros(self.size, dtype=torch.int64)
        lengths[self.rank] = t.shape[0] if t.dim() else 1
        self._call("allgather", lambda: dist.all_reduce(lengths, op=dist.ReduceOp.SUM))
        flat = t.reshape(-1) if t.dim() else t.reshape(1)
        # elements per row from the shape, so a rank with zero rows pads like the others
        row = math.prod(t.shape[1:]) if t.dim() else 1
        longest = int(lengths.max().item())
        padded = torch.zeros(longest * row, dtype=t.dtype)
        padded[: flat.numel()] = flat
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        if padded.numel():
            self._call("allgather", lambda: dist.all_gather(parts, padded))
        pieces = [p[: int(n) * row] for p, n in zip(parts, lengths.tolist(), strict=False)]
        out = torch.cat(pieces).reshape(-1, *t.shape[1:]) if t.dim() else torch.cat(pieces)
        return out.numpy() if isinstance(value, np.ndarray) else out

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
        self._max_buf[0] = value
        self._call("check_host_updates", lambda: dist.all_reduce(self._max_buf, op=dist.ReduceOp.MAX))
        return int(self._max_buf[0])

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken ring may fail to tear down; it is dropped either way
                pass
