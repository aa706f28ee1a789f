"""Horovod's PyTorch collectives, with their signatures, on the current generation's ring.

Each function takes Horovod's arguments and calls ray-elastic's collective
(`ray_elastic.allreduce` and friends: arguments checked and agreed on across
ranks, a broken ring raised as `HorovodInternalError`). What the arguments
mean here:

- `op`: `Average` (the default), `Sum`, `Min`, `Max`. `Adasum` and `Product`
  raise `NotImplementedError` naming them. The deprecated `average=True/False`
  stands for `Average`/`Sum`, as in Horovod.
- `prescale_factor`, `postscale_factor`: the tensor is multiplied before and
  the result after the reduction, in the tensor's dtype.
- `compression`: `Compression.none` or `Compression.fp16` (or a compressor of
  one's own with Horovod's interface).
- `name`: accepted and unused. Horovod matches a collective across ranks by
  name; ray-elastic by call order, which is the same for any script whose
  ranks make the same calls (checked: a mismatch raises
  `CollectiveMismatchError` naming each rank's call).
- `process_set`: only `global_process_set`; another raises `NotImplementedError`.

`allreduce`, `allgather` and `broadcast` are differentiable as in Horovod
(the backward pass reduces the gradients). The `*_async` variants run the
collective at once and return a handle whose `synchronize()` gives the
result and whose `poll()` is always True: same results, no overlap.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

import ray_elastic
from ray_elastic import Average, Max, Min, ReduceOp, Sum
from ray_elastic.horovod.torch.compression import Compression


class UnsupportedOp:
    """A Horovod reduce op with no counterpart here; using it raises `NotImplementedError`."""

    def __init__(self, name: str, advice: str) -> None:
        self.name = name
        self.advice = advice

    def __repr__(self) -> str:
        return f"hvd.{self.name}"


Adasum = UnsupportedOp(
    "Adasum",
    "ray-elastic has no Adasum reduction; use op=hvd.Average and scale the learning rate by hvd.size()",
)
Product = UnsupportedOp("Product", "ray-elastic reduces with Sum, Average, Min or Max only")


class ProcessSetNotSupported:
    """Horovod's `global_process_set`: all ranks, the only process set ray-elastic has."""

    def __repr__(self) -> str:
        return "hvd.global_process_set"


global_process_set = ProcessSetNotSupported()


def reduce_op(op: Any, average: bool | None = None, where: str = "allreduce") -> ReduceOp:
    """Horovod's `op`/`average` pair as a ray-elastic `ReduceOp` (Average when both are None)."""
    if average is not None:
        if op is not None:
            raise ValueError(f"{where}: pass op= or the deprecated average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, UnsupportedOp):
        raise NotImplementedError(f"{where}(op=hvd.{op.name}) is not supported: {op.advice}")
    if op in (Average, Sum, Min, Max):
        return op
    raise ValueError(f"{where}: op must be hvd.Average, hvd.Sum, hvd.Min or hvd.Max, got {op!r}")


def check_process_set(process_set: Any, where: str) -> None:
    if process_set is not global_process_set:
        raise NotImplementedError(
            f"{where}(process_set=...) is not supported: ray-elastic has one process set, all ranks "
            "(hvd.global_process_set)"
        )


def _check_name(name: Any, where: str) -> None:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"{where}: name must be a string or None, got {type(name).__name__}")


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    if factor == 1.0:
        return tensor
    return (tensor * factor).to(tensor.dtype)


def _reduce(tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float) -> torch.Tensor:
    out = ray_elastic.allreduce(_scaled(tensor.detach(), prescale), op)
    return _scaled(out, postscale)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: ReduceOp, prescale: float, postscale: float) -> torch.Tensor:
        ctx.args = (op, prescale, postscale)
        return _reduce(tensor, op, prescale, postscale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _reduce(grad, *ctx.args), None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """`tensor` reduced over all ranks (default: averaged), as a new tensor; `tensor` is left as it is."""
    reduce = reduce_op(op, average)
    _check_name(name, "allreduce")
    check_process_set(process_set, "allreduce")
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = _Allreduce.apply(compressed, reduce, prescale_factor, postscale_factor)
    else:
        out = _reduce(compressed, reduce, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` over all ranks in place (default: average), and return it."""
    reduce = reduce_op(op, average, "allreduce_")
    _check_name(name, "allreduce_")
    check_process_set(process_set, "allreduce_")
    if prescale_factor == 1.0 and postscale_factor == 1.0:
        return ray_elastic.allreduce_(tensor, reduce)
    with torch.no_grad():
        tensor.copy_(_reduce(tensor, reduce, prescale_factor, postscale_factor))
    return tensor


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """`allreduce` of each tensor, in order."""
    return [
        allreduce(t, average, name, compression, op, prescale_factor, postscale_factor, process_set) for t in tensors
    ]


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> list[torch.Tensor]:
    """`allreduce_` of each tensor, in order."""
    return [allreduce_(t, average, name, op, prescale_factor, postscale_factor, process_set) for t in tensors]


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rows = tensor.shape[0]
        return ray_elastic.allgather(tensor.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        reduced = ray_elastic.allreduce(grad.contiguous(), Average)
        rows = ray_elastic.allgather(torch.tensor([ctx.rows], dtype=torch.int64))
        offset = int(rows[: ray_elastic.rank()].sum())
        return reduced.narrow(0, offset, ctx.rows)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    """Every rank's tensor concatenated along the first dimension, in rank order (first dimensions may differ)."""
    _check_name(name, "allgather")
    check_process_set(process_set, "allgather")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Allgather.apply(tensor)
    return ray_elastic.allgather(tensor)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int) -> torch.Tensor:
        ctx.root_rank = root_rank
        return ray_elastic.broadcast(tensor.detach(), root_rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = ray_elastic.allreduce(grad.contiguous(), Average)
        if ray_elastic.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """`root_rank`'s tensor on every rank, as a new tensor."""
    _check_name(name, "broadcast")
    check_process_set(process_set, "broadcast")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _Broadcast.apply(tensor, root_rank)
    return ray_elastic.broadcast(tensor, root_rank)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> torch.Tensor:
    """Overwrite `tensor` with `root_rank`'s, in place, and return it."""
    _check_name(name, "broadcast_")
    check_process_set(process_set, "broadcast_")
    with torch.no_grad():
        return ray_elastic.broadcast_(tensor, root_rank)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = global_process_set
) -> Any:
    """`root_rank`'s picklable object on every rank."""
    _check_name(name, "broadcast_object")
    check_process_set(process_set, "broadcast_object")
    return ray_elastic.broadcast_object(obj, root_rank)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    _check_name(name, "allgather_object")
    check_process_set(process_set, "allgather_object")
    return ray_elastic.allgather_object(obj)


def barrier(process_set: Any = global_process_set) -> None:
    """Return once every rank has reached the barrier."""
    check_process_set(process_set, "barrier")
    ray_elastic.barrier()


def join(device: int = -1) -> int:
    """Not supported: raises `NotImplementedError`.

    Horovod's `join()` lets ranks that ran out of data contribute zeros to the
    others' allreduces; ray-elastic's ring has no such mode.
    """
    raise NotImplementedError(
        "hvd.join() is not supported: ray-elastic's ring has no mode in which finished ranks contribute zeros "
        "to the others' allreduces. Give every rank the same number of batches (hvd.elastic.ElasticSampler "
        "splits each epoch evenly) and use hvd.barrier() where ranks must meet."
    )


# ---- asynchronous variants: run now, hand out a handle ---------------------------------

_results: dict[int, Any] = {}
_handles = itertools.count(1)


def _handle(result: Any) -> int:
    handle = next(_handles)
    _results[handle] = result
    return handle


def poll(handle: int) -> bool:
    """Whether the operation of `handle` finished: always True here (it ran when it was started)."""
    if handle not in _results:
        raise ValueError(f"unknown or already synchronized handle {handle!r}")
    return True


def synchronize(handle: int) -> Any:
    """The result of the operation of `handle` (None for a handle already synchronized, as in Horovod)."""
    return _results.pop(handle, None)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """`allreduce`, run now; `synchronize(handle)` returns the result."""
    return _handle(
        allreduce(tensor, average, name, Compression.none, op, prescale_factor, postscale_factor, process_set)
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """`allreduce_`, run now; `synchronize(handle)` returns the tensor."""
    return _handle(allreduce_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """`grouped_allreduce`, run now; `synchronize(handle)` returns the list."""
    return _handle(
        grouped_allreduce(tensors, average, name, Compression.none, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = global_process_set,
) -> int:
    """`grouped_allreduce_`, run now; `synchronize(handle)` returns the list."""
    return _handle(grouped_allreduce_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> int:
    """`allgather`, run now; `synchronize(handle)` returns the result."""
    return _handle(allgather(tensor, name, process_set))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> int:
    """`broadcast`, run now; `synchronize(handle)` returns the result."""
    return _handle(broadcast(tensor, root_rank, name, process_set))


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = global_process_set
) -> int:
    """`broadcast_`, run now; `synchronize(handle)` returns the tensor."""
    return _handle(broadcast_(tensor, root_rank, name, process_set))
