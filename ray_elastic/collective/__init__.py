"""Collectives on the current generation's ring, as workers call them.

`allreduce`, `broadcast`, `allgather` take torch tensors or numpy arrays and
return new values (`allreduce_` and `broadcast_` work in place);
`broadcast_object` and `allgather_object` take picklable objects. Each joins
the ring first if this worker has not yet, and any ring failure raises
`HorovodInternalError`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ray_elastic.collective.base import Average, CollectiveGroup, Max, Min, ReduceOp, Sum
from ray_elastic.runtime.process import current

T = TypeVar("T")

__all__ = [
    "Average",
    "CollectiveGroup",
    "Max",
    "Min",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "group",
]


def group() -> CollectiveGroup:
    """The current generation's ring (joining it first if needed)."""
    ctx = current()
    ctx.ensure_joined()
    return ctx.group


def allreduce(value: T, op: ReduceOp = Average) -> T:
    return group().allreduce(value, op)


def allreduce_(value: T, op: ReduceOp = Average) -> T:
    return group().allreduce_(value, op)


def broadcast(value: T, root_rank: int = 0) -> T:
    return group().broadcast(value, root_rank)


def broadcast_(value: T, root_rank: int = 0) -> T:
    return group().broadcast_(value, root_rank)


def allgather(value: T) -> T:
    return group().allgather(value)


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    return group().broadcast_object(obj, root_rank)


def allgather_object(obj: Any) -> list[Any]:
    return group().allgather_object(obj)


def barrier() -> None:
    group().barrier()
