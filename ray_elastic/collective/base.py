"""The one small interface every collective backend implements.

A `CollectiveGroup` is one ring for one generation: built after the
rendezvous, used for the generation's collectives, closed on reset. Values
are torch tensors or numpy arrays; results come back in the caller's type.
Any failure of the ring surfaces as `HorovodInternalError`, through the one
`guarded_call` every blocking wait of every backend goes through.

The torch helpers (`DistributedOptimizer`, `TorchState`) use this interface
only: `allreduce_async` for gradient buckets that overlap backward, and
`bitwise_or_` for the sampler's processed-sample bitmaps.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ray_elastic.collective.activity import collective_activity
from ray_elastic.exceptions import HorovodInternalError

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"


Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX


class CollectiveGroup(ABC):
    """One generation's communication ring."""

    name: str = "abstract"

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.abandoned: str | None = None  # why, once the driver said this generation's ring is dead

    def abandon(self, reason: str) -> None:
        """The driver says this generation's ring is dead (a member was lost). Called from another thread.

        Every later collective fails at once with `HorovodInternalError`;
        backends that can (torch Gloo) also release a collective blocked in
        the ring right now, whether or not this rank was connected to the
        lost one. The others (pygloo, NCCL) leave it to their own timeout.
        Called again, it keeps the first reason.
        """
        if self.abandoned is None:
            self.abandoned = reason

    def raised(self, error: BaseException) -> bool:
        """Whether `error` was raised by this ring's own transport, reached through a library's collectives.

        Torch's backends say yes to torch.distributed's errors, which a
        library calling the default process group itself (FSDP2's all-gather
        and reduce-scatter) raises as they are; others know no such errors.
        """
        return False

    def check_abandoned(self, what: str) -> None:
        if self.abandoned is not None:
            raise HorovodInternalError(f"{what} not started: {self.abandoned}")

    @abstractmethod
    def allreduce_(self, value: T, op: ReduceOp = Average) -> T:
        """Reduce `value` across ranks in place and return it.

        Average divides the sum by the world size; on integer types it rounds
        toward minus infinity (floor division), as numpy's `//` does.
        """

    @abstractmethod
    def broadcast_(self, value: T, root_rank: int = 0) -> T:
        """Overwrite `value` on every rank with root's, in place; return it."""

    @abstractmethod
    def allgather(self, value: T) -> T:
        """Concatenate every rank's `value` along the first dimension, rank order.

        The first dimension may differ between ranks; the others must match.
        """

    @abstractmethod
    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Root's picklable object on every rank."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has reached the barrier."""

    @abstractmethod
    def close(self) -> None:
        """Tear the ring down; safe to call after a failure."""

    def max_int(self, value: int) -> int:
        """The largest of one integer over all ranks (used to agree on host updates)."""
        return int(self.allreduce_(np.array([value], dtype=np.int64), Max)[0])

    def allreduce_async(self, value: T, op: ReduceOp = Average) -> CollectiveWork:
        """Start reducing `value` in place; it holds the result once the handle's `wait()` returned.

        Every rank must start its asynchronous collectives in the same order.
        This default reduces at once, before returning a finished handle (the
        pygloo backend: no overlap with the caller's work); the torch backends
        return torch's own pending work.
        """
        self.allreduce_(value, op)
        return CollectiveWork()

    def bitwise_or_(self, value: np.ndarray) -> np.ndarray:
        """OR a numpy integer array across ranks in place and return it.

        This default gathers every rank's array and ORs them (N times the
        array's size on the wire); backends with a bitwise-or reduction
        override it.
        """
        if self.size == 1:
            return value
        rows = self.allgather(value.reshape(1, -1))
        np.bitwise_or.reduce(rows, axis=0, out=value.reshape(-1))
        return value

    # point-to-point messages: a sync sends state to the ranks that need it, and only to them
    point_to_point = False  # send_async / recv_async work on this backend

    def send_async(self, value: T, dst: int) -> CollectiveWork:
        """Start sending `value` to rank `dst`, which posts a matching `recv_async`; don't touch it before `wait()`.

        Messages between two ranks arrive in the order they were sent. A
        broken link raises `HorovodInternalError` at `wait()`, after at most
        `collective_timeout`.
        """
        raise NotImplementedError(f"the {self.name} backend has no point-to-point messages")

    def recv_async(self, value: T, src: int) -> CollectiveWork:
        """Start receiving into `value` (same size as what `src` sends); it holds the message once `wait()` returned."""
        raise NotImplementedError(f"the {self.name} backend has no point-to-point messages")

    def allreduce(self, value: T, op: ReduceOp = Average) -> T:
        """Like `allreduce_`, on a copy: `value` itself is left untouched."""
        return self.allreduce_(_copy(value), op)

    def broadcast(self, value: T, root_rank: int = 0) -> T:
        """Like `broadcast_`, on a copy."""
        return self.broadcast_(_copy(value), root_rank)


def _copy(value: Any) -> Any:
    clone = getattr(value, "clone", None)
    if clone is not None:
        return clone()
    return value.copy()


R = TypeVar("R")


def guarded_call(what: str, fn: Callable[[], R]) -> R:
    """Run one blocking collective of a backend.

    Marks the worker as inside a collective meanwhile (the driver's stuck-rank
    detection reads it) and turns a broken ring (a peer's connection closed,
    a timeout, a store error) into `HorovodInternalError` naming `what`.
    """
    collective_activity(True)
    try:
        return fn()
    except HorovodInternalError:
        raise
    except (RuntimeError, ConnectionError, TimeoutError) as e:
        raise HorovodInternalError(f"{what} failed: {e}") from e
    finally:
        collective_activity(False)


class CollectiveWork:
    """A collective in flight, from `CollectiveGroup.allreduce_async`.

    Args:
        what: the collective's name, for the error if its wait fails.
        wait: blocks until the backend finished (through `guarded_call`);
            None for a collective already done.
        then: runs once after `wait`, finishing the result in the caller's
            value (dividing for `Average`, copying back from a device).
    """

    def __init__(
        self, what: str = "", wait: Callable[[], Any] | None = None, then: Callable[[], None] | None = None
    ) -> None:
        self._what = what
        self._wait = wait
        self._then = then

    def wait(self) -> None:
        """Block until the result is in the value; a broken ring raises `HorovodInternalError`."""
        wait, self._wait = self._wait, None
        if wait is not None:
            guarded_call(self._what, wait)
        then, self._then = self._then, None
        if then is not None:
            then()
