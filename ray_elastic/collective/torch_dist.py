"""A torch.distributed process group over the run's KV actor: what Gloo and NCCL share.

The process group is created over a `Store` of one generation, destroyed on
reset and created again in the same process (tens of milliseconds).

Gloo collectives can be abandoned: each one is started asynchronously and
waited on through its future and an event that `abandon()` (the driver
saying a member of this generation was lost) also sets, so a rank blocked in
the ring leaves it at once instead of after `collective_timeout`, even when
it was not connected to the lost rank (a ring allreduce waits on its
neighbours only). torch cannot cancel the Gloo operation itself, so
`abandon()` first cuts the ring's connections (`ring_sockets`) and waits
until every pending work has ended: only then are the waiters released, and
nothing of the dead ring writes into a tensor afterwards, even if the
network heals (invariant 7). A work that outlives that bound (it should not)
is logged, counted (`late_completions`), and kept referenced with its
process group in a graveyard, because dropping it would block in its
destructor until the operation ends. A backend
subclass says which torch backend it runs and on which device values must
live; `_stage` moves a caller's value there and back. numpy arrays go through
`torch.from_numpy`, which shares their memory, so on CPU in-place operations
write straight into the caller's array.
"""

from __future__ import annotations

import logging
import math
import pickle
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ray_elastic.collective.base import CollectiveGroup, CollectiveWork, ReduceOp, guarded_call
from ray_elastic.exceptions import HorovodInternalError

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.collective.ring_sockets import RingSockets

logger = logging.getLogger(__name__)

T = TypeVar("T")

# abandoned process groups, kept with their pending works until Gloo's timeout ends those
_graveyard: list[tuple[Any, list[Any]]] = []
# works of a left ring that completed without error after it was left: each wrote into a buffer it no longer owned
_late_completions: list[str] = []
# how long leaving a ring waits for its works to end once its connections are cut (they fail within milliseconds)
SETTLE_S = 2.0
# how long a wait blocks in torch's C++ before it registers a callback that the driver's abandon can end
_SHORT_WAIT = timedelta(milliseconds=5)

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


# what Gloo's transport says when a peer's process or connection is gone (pair.cc, in a RuntimeError)
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")


def is_torch_ring_error(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) came from torch.distributed's transport failing.

    A `DistError` (torch's own type for backend and store failures), or a
    `RuntimeError` that names Gloo (its messages carry its source files'
    paths) or says a peer's connection is gone. FSDP2 raises these from its
    all-gather in forward and its reduce-scatter in backward, where autograd
    may wrap them; the chain of causes is followed.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, dist.DistError):
            return True
        if isinstance(current, RuntimeError):
            text = str(current).lower()
            if "gloo" in text or any(lost in text for lost in _LOST_PEER):
                return True
        current = current.__cause__ or current.__context__
    return False


class TorchDistGroup(CollectiveGroup):
    """One generation's torch.distributed default process group."""

    backend = "abstract"
    abortable = False  # its collectives can be abandoned while blocked (Gloo); NCCL waits on its own watchdog
    _sockets: RingSockets | None = None  # the ring's connections, where a backend can cut them (Gloo)

    def __init__(
        self, store: dist.Store, rank: int, size: int, timeout: float, device: torch.device | None = None
    ) -> None:
        super().__init__(rank, size)
        self.device = device or torch.device("cpu")
        self._timeout_s = timeout
        self._lock = threading.Lock()
        self._cutting = threading.Lock()  # one cut at a time: a second caller returns once the first is done
        self._waiting: set[threading.Event] = set()
        # works started and not yet seen finished (abandoned, or never waited on), by id: a finished one is
        # dropped at once (holding DDP's bucket works until dozens piled up cost 5-15% of a step at 23M)
        self._inflight: dict[int, Any] = {}
        self._futures: dict[int, tuple[torch.futures.Future, str]] = {}  # abandonable_future's, not yet completed
        self._store = store  # torch calls back into this Python object: keep it alive with the group
        if not dist.is_initialized():
            # torch names the default group from a counter that only a successful destroy resets;
            # after a ring that failed to form, ranks would disagree on the name and never meet
            dist.distributed_c10d._world.group_count = 0
        self._call(
            "init_process_group",
            lambda: self._create(
                lambda: dist.init_process_group(
                    self.backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
                )
            ),
        )
        self._max_buf = torch.zeros(1, dtype=torch.int64, device=self.device)

    def _stage(self, value: Any) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """`value` as a tensor on this group's device, and how to copy a result back (None: shared)."""
        return as_tensor(value), None

    def _stage_reduced(self, value: Any) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """`_stage` for an allreduce or a broadcast, which a backend may take on the device as it is."""
        return self._stage(value)

    _call = staticmethod(guarded_call)

    def _create(self, create: Callable[[], None]) -> None:
        """Create the process group; a backend whose connections can be cut notes them here."""
        create()

    def raised(self, error: BaseException) -> bool:
        """torch.distributed's errors are this ring's: it is the default process group every torch library uses."""
        return is_torch_ring_error(error)

    # ---- waiting, abandonably -------------------------------------------------------
    def abandon(self, reason: str) -> None:
        """Fail this generation's collectives; where the ring can be cut, only once its works have ended.

        Cutting first, then releasing the waiters, means the training thread
        never rolls back while a dead work can still write into its tensors.
        """
        super().abandon(reason)
        self._cut_ring()
        with self._lock:
            for event in self._waiting:
                event.set()
            futures, self._futures = list(self._futures.values()), {}
        for future, what in futures:
            future.set_exception(HorovodInternalError(f"{what} abandoned: {reason}"))

    def start(self, what: str, start: Callable[[], Any]) -> Any:
        """Start one asynchronous torch collective (its `Work`), unless this generation was abandoned."""
        self.check_abandoned(what)
        work = self._call(what, start)
        self._inflight[id(work)] = work
        return work

    def abandonable_future(
        self, what: str, start: Callable[[], Any], result: Callable[[], torch.Tensor]
    ) -> torch.futures.Future:
        """Start one collective; a torch future that completes with `result()` when it ends.

        The future fails with `HorovodInternalError` on the ring's error, and
        at once when this generation is abandoned: whoever waits on it (DDP's
        C++ reducer, for a communication hook's future) leaves then, while
        the operation itself stays pending on Gloo's thread (see `close`).
        """
        future: torch.futures.Future = torch.futures.Future()
        work = self.start(what, start)
        key = id(future)
        with self._lock:
            self._futures[key] = (future, what)

        def on_done(done: torch.futures.Future) -> None:
            with self._lock:
                if self._futures.pop(key, None) is None:
                    return  # failed already, by abandon()
            self._inflight.pop(id(work), None)
            try:
                done.wait()  # raises the ring's error
                value = result()
            except Exception as e:  # noqa: BLE001 - handed to the future's waiter
                future.set_exception(HorovodInternalError(f"{what} failed: {e}"))
                return
            future.set_result(value)

        work.get_future().add_done_callback(on_done)
        if self.abandoned is not None:  # abandoned between the start and the registration: fail it now
            with self._lock:
                pending = self._futures.pop(key, None)
            if pending is not None:
                future.set_exception(HorovodInternalError(f"{what} abandoned: {self.abandoned}"))
        return future

    def wait_work(self, what: str, work: Any) -> None:
        """Wait for a work from `start`, abandonably; the ring's error (or the abandon) as `HorovodInternalError`."""
        self._call(what, lambda: self._wait(what, work))

    def _wait(self, what: str, work: Any) -> None:
        """Block until `work` is done, or this generation is abandoned (then `HorovodInternalError`).

        Most works end within a few milliseconds of the wait: a short wait in
        torch's C++ catches those. Only a longer one registers a Python
        callback on Gloo's thread, which takes the GIL to run and competes
        with the training thread for it (and makes Gloo's thread use
        markedly more CPU than under plain DDP).
        """
        if self.abortable and self.abandoned is None and not work.is_completed():
            try:
                work.wait(_SHORT_WAIT)
            except RuntimeError:
                pass  # not done yet (torch's "Operation timed out!"), or failed: raised again below
        if not self.abortable or work.is_completed():
            work.wait()  # done: returns at once, or raises the ring's error
            self._inflight.pop(id(work), None)
            return
        done = threading.Event()
        finished: list[bool] = []  # the future's callback ran: the work ended (Work.is_completed() may lag it)

        def on_done(_: Any) -> None:
            finished.append(True)
            done.set()

        with self._lock:
            self._waiting.add(done)
        try:
            work.get_future().add_done_callback(on_done)
            if self.abandoned is None and not done.wait(self._timeout_s + 5.0):
                raise HorovodInternalError(f"{what} did not finish within collective_timeout={self._timeout_s:g} s")
        finally:
            with self._lock:
                self._waiting.discard(done)
        if not finished:
            raise HorovodInternalError(f"{what} abandoned: {self.abandoned}")
        self._inflight.pop(id(work), None)
        work.wait()  # done: returns at once, or raises the ring's error

    def _run(self, what: str, start: Callable[[], Any]) -> None:
        """Start one collective and wait for it, abandonably."""
        self.wait_work(what, self.start(what, start))

    def allreduce_(self, value: T, op: ReduceOp = ReduceOp.AVERAGE) -> T:
        t, write_back = self._stage_reduced(value)
        if t.numel() == 0 or self.size == 1:
            return value
        self._run("allreduce", lambda: dist.all_reduce(t, op=_TORCH_OPS[op], async_op=True))
        self._finish_allreduce(t, op, write_back)
        return value

    def allreduce_async(self, value: T, op: ReduceOp = ReduceOp.AVERAGE) -> CollectiveWork:
        """torch's asynchronous allreduce: the ring works while the caller goes on (backward, for buckets)."""
        t, write_back = self._stage_reduced(value)
        if t.numel() == 0 or self.size == 1:
            return CollectiveWork()
        work = self.start("allreduce", lambda: dist.all_reduce(t, op=_TORCH_OPS[op], async_op=True))
        return CollectiveWork(
            "allreduce", lambda: self._wait("allreduce", work), lambda: self._finish_allreduce(t, op, write_back)
        )

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
        t, write_back = self._stage_reduced(value)
        if t.numel() == 0 or self.size == 1:
            return value
        self._run("broadcast", lambda: dist.broadcast(t, src=root_rank, async_op=True))
        if write_back is not None:
            write_back()
        return value

    point_to_point = True

    def send_async(self, value: T, dst: int) -> CollectiveWork:
        t, _ = self._stage(value)
        what = f"send to rank {dst}"
        work = self.start(what, lambda: dist.isend(t, dst))
        # `t` may be a staging copy only this closure holds: it must live until the send ended
        return CollectiveWork(what, lambda: self._wait_message(what, work, t))

    def recv_async(self, value: T, src: int) -> CollectiveWork:
        t, write_back = self._stage(value)
        what = f"receive from rank {src}"
        work = self.start(what, lambda: dist.irecv(t, src))
        return CollectiveWork(what, lambda: self._wait_message(what, work), write_back)

    def _wait_message(self, what: str, work: Any, buffer: torch.Tensor | None = None) -> None:
        """Wait for a send or receive: torch gives no future for those, so no early release on abandon.

        A peer that died closes the link (an error within milliseconds); a
        silent one is bounded by the process group's `collective_timeout`.
        """
        self.check_abandoned(what)
        work.wait()
        self._inflight.pop(id(work), None)

    def allgather(self, value: T) -> T:
        t, _ = self._stage(value)
        if self.size == 1:
            out = t.clone() if t.dim() else t.reshape(1).clone()
        else:
            out = _allgather_rows(self, t)
        if isinstance(value, np.ndarray):
            return out.cpu().numpy()
        assert isinstance(value, torch.Tensor)  # `_stage` took a tensor or an array: nothing else comes here
        return out.to(value.device)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Root's object, pickled into a byte tensor: two broadcasts (length, then bytes), both abandonable."""
        if self.size == 1:
            return obj
        payload = pickle.dumps(obj) if self.rank == root_rank else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self._run("broadcast_object", lambda: dist.broadcast(length, src=root_rank, async_op=True))
        if self.rank == root_rank:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        if data.numel():
            self._run("broadcast_object", lambda: dist.broadcast(data, src=root_rank, async_op=True))
        return obj if self.rank == root_rank else pickle.loads(data.cpu().numpy().tobytes())

    def allgather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        lengths = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        lengths[self.rank] = payload.numel()
        self._run("allgather_object", lambda: dist.all_reduce(lengths, op=dist.ReduceOp.SUM, async_op=True))
        counts = lengths.tolist()
        padded = torch.zeros(max(counts), dtype=torch.uint8, device=self.device)
        padded[: payload.numel()] = payload
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._run("allgather_object", lambda: dist.all_gather(parts, padded, async_op=True))
        return [pickle.loads(p[: int(n)].cpu().numpy().tobytes()) for p, n in zip(parts, counts, strict=True)]

    def barrier(self) -> None:
        if self.size > 1:
            self._run("barrier", lambda: dist.barrier(async_op=True))

    def max_int(self, value: int) -> int:
        """Max of one integer over all ranks, on a buffer allocated once."""
        if self.size == 1:
            return value
        self._max_buf.fill_(value)
        self._run("check_host_updates", lambda: dist.all_reduce(self._max_buf, op=dist.ReduceOp.MAX, async_op=True))
        return int(self._max_buf.item())

    def _cut_ring(self) -> list[Any]:
        """Cut the ring's connections and wait (at most `SETTLE_S`) for its works to end; those still pending."""
        with self._cutting:
            return _cut_and_settle(self._sockets, list(self._inflight.values()), self.backend)

    def close(self) -> None:
        _graveyard[:] = [(pg, works) for pg, works in _graveyard if not all(w.is_completed() for w in works)]
        pending = [w for w in self._inflight.values() if not w.is_completed()]
        if pending or self.abandoned is not None:
            # a broken ring (a bucket never waited on after an earlier one failed, or an abandoned collective):
            # its works must end before its buffers are reused; a healthy ring's last bytes are left to arrive
            pending = self._cut_ring()
        self._inflight = {}
        if dist.is_initialized():
            # dropping the group with a work pending would block in its destructor until Gloo times it out
            if pending:
                _watch_late(pending, self.backend)
                _graveyard.append((dist.distributed_c10d._get_default_group(), pending))
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken ring may fail to tear down; it is dropped either way
                pass


def _allgather_rows(group: TorchDistGroup, t: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of `t`, concatenated by rank: ranks may hold different numbers of rows.

    The counts are summed first, then each rank's rows are padded to the
    longest and gathered; the padding is cut off again.
    """
    lengths = torch.zeros(group.size, dtype=torch.int64, device=group.device)
    lengths[group.rank] = t.shape[0] if t.dim() else 1
    group._run("allgather", lambda: dist.all_reduce(lengths, op=dist.ReduceOp.SUM, async_op=True))
    counts = lengths.tolist()
    flat = t.reshape(-1) if t.dim() else t.reshape(1)
    # elements per row from the shape, so a rank with zero rows pads like the others
    row = math.prod(t.shape[1:]) if t.dim() else 1
    padded = torch.zeros(max(counts) * row, dtype=t.dtype, device=group.device)
    padded[: flat.numel()] = flat
    parts = [torch.empty_like(padded) for _ in range(group.size)]
    if padded.numel():
        group._run("allgather", lambda: dist.all_gather(parts, padded, async_op=True))
    pieces = [p[: int(n) * row] for p, n in zip(parts, counts, strict=False)]
    return torch.cat(pieces).reshape(-1, *t.shape[1:]) if t.dim() else torch.cat(pieces)


def _cut_and_settle(sockets: RingSockets | None, works: list[Any], backend: str) -> list[Any]:
    """Cut the ring's connections (where they can be), then wait up to `SETTLE_S` for `works`; those still pending."""
    pending = [w for w in works if not w.is_completed()]
    if sockets is None:
        return pending
    sockets.cut()
    deadline = time.monotonic() + SETTLE_S
    still = [w for w in pending if not _ends_within(w, deadline - time.monotonic())]
    if still:
        logger.warning(
            "%d collective(s) of an abandoned %s ring did not end within %g s of cutting its connections",
            len(still),
            backend,
            SETTLE_S,
        )
    return still


def _ends_within(work: Any, timeout: float) -> bool:
    """Whether `work` ended (done or failed) within `timeout` s."""
    timeout = max(timeout, 0.001)
    try:
        future = work.get_future()
    except RuntimeError:  # Gloo's send and receive works have no future: their own wait, bounded
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError:
            pass  # failed (ended), or still pending after `timeout` (torch's "timed out")
        return work.is_completed()
    ended = threading.Event()
    future.add_done_callback(lambda _: ended.set())
    return ended.wait(timeout)


def _watch_late(works: list[Any], backend: str) -> None:
    """Count (and log) each work of a left ring that still completes without error: it wrote into a stale buffer."""
    for work in works:
        try:
            future = work.get_future()
        except RuntimeError:  # a send or receive: no future to watch; the warning at the cut named it
            continue

        def on_done(future: torch.futures.Future) -> None:
            try:
                future.wait()
            except Exception:  # noqa: BLE001 - a failed work wrote nothing: the expected end
                return
            _late_completions.append(backend)
            logger.error("a collective of a left %s ring completed after the ring was left", backend)

        future.add_done_callback(on_done)


def late_completions() -> int:
    """How many works of left rings completed without error in this process (0 where fencing holds)."""
    return len(_late_completions)
