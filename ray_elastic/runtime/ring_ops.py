"""Collectives on the current generation's ring, as workers call them (`ray_elastic.allreduce`, ...).

`allreduce`, `broadcast`, `allgather` take torch tensors or numpy arrays and
return new values (`allreduce_` and `broadcast_` work in place); `allreduce`
and `broadcast` also take a Python or numpy number and return one of the
same type. `op` is `Sum`, `Average`, `Min`, `Max` or one of their names
("sum", "average", "min", "max"). Their arguments are checked first, and
agreed on across ranks: a call whose dtype, shape, op or root rank differs
between ranks raises `CollectiveMismatchError` on every rank (see
`checked.py` for what it costs and `set_argument_checks` to turn it off).
`broadcast_object` and `allgather_object` take picklable objects. Each joins
the ring first if this worker has not yet, and any ring failure raises
`HorovodInternalError`.

The library's own collectives call the ring's methods, which check nothing,
on the `Generation` they were handed (`WorkerContext.joined().ring`);
`group()` is the process's, for the adapters.
"""

from __future__ import annotations

from typing import Any, TypeVar

from ray_elastic.collective import checked
from ray_elastic.collective.base import Average, CollectiveGroup, ReduceOp
from ray_elastic.runtime.process import current

T = TypeVar("T")

__all__ = [
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
    """The current generation's ring (joining it first if needed): the process's, as a user's call finds it."""
    return current().joined().ring


def allreduce(value: T, op: ReduceOp | str = Average) -> T:
    """`value` reduced over all ranks, as a new value (a number for a number); `value` is left as it is."""
    return checked.allreduce(group(), value, op)


def allreduce_(value: T, op: ReduceOp | str = Average) -> T:
    """Reduce a tensor or array over all ranks in place, and return it."""
    return checked.allreduce_(group(), value, op)


def broadcast(value: T, root_rank: int = 0) -> T:
    """`root_rank`'s value on every rank, as a new value (a number for a number)."""
    return checked.broadcast(group(), value, root_rank)


def broadcast_(value: T, root_rank: int = 0) -> T:
    """Overwrite a tensor or array with `root_rank`'s, in place, and return it."""
    return checked.broadcast_(group(), value, root_rank)


def allgather(value: T) -> T:
    """Every rank's tensor or array concatenated along the first dimension, in rank order."""
    return checked.allgather(group(), value)


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """`root_rank`'s picklable object on every rank."""
    ring = group()
    return ring.broadcast_object(obj, checked.root_rank_in(root_rank, ring.size))


def allgather_object(obj: Any) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    return group().allgather_object(obj)


def barrier() -> None:
    """Return once every rank has reached the barrier."""
    group().barrier()
