"""Moving tensors between ranks: `send_tensors_` for syncs, `broadcast_tensors_` and Horovod's `broadcast_parameters`.

`send_tensors_` carries out a `SyncPlan` (see `ray_elastic.state.sync_plan`):
the tensors' bytes go in chunks of at most `CHUNK_BYTES` from the ranks that
hold the commit to the ranks that do not, and only to them. A chunk is a
slice of one large tensor (sent from and received into the tensor itself, no
copy) or several small tensors of one device packed into one message (all
the small ones first, so a model's biases cost one message, not one each;
a chunk never mixes devices: a GPU model's biases and AdamW's step counts,
which torch keeps on the host, travel in separate messages, each staged on
its own device); at most `WINDOW * CHUNK_BYTES` bytes per rank are in flight, so the
extra memory is bounded by that whatever the model's size. The bound is in
bytes, not chunks: a model of 4 MB tensors travels in 4 MB chunks, and 4 of
them in flight left the ranks waiting on each other's wake-ups (a 100M
newcomer's sync took 0.33-0.35 s, against 0.31 s with 16 in flight, in a
3-process harness). With several
holders, each sends its own contiguous share, so a receiver draws from all
of them. A receiver's tensors are often fresh memory (a newcomer's optimizer
moments), whose first touch costs about as much as the transfer itself on a
VM: a thread faults each chunk's pages in ahead of its receive
(`ray_elastic.state.pages`: without writing them, so it never holds a
receive back), and the page faults overlap the transfer instead of
following it.

While this process sends or receives, `wait_while_transferring()` blocks:
a survivor's background copy of its commit (see `ray_elastic.torch.state`)
holds off meanwhile, since its memory traffic made each of a newcomer's page
faults about 3 times as costly when both ran at once.

`broadcast_tensors_` copies rank 0's tensors to every rank, coalesced per
device and dtype (one flat broadcast each), for the user-facing helpers.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from ray_elastic.collective.base import CollectiveGroup, CollectiveWork
from ray_elastic.collective.checked import root_rank_in
from ray_elastic.runtime.ring_ops import group
from ray_elastic.state.pages import can_populate, populate_range, resident_range
from ray_elastic.state.sync_plan import Chunk, SyncPlan, order_transfers, schedule_chunks

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

CHUNK_BYTES = 16 * 2**20
WINDOW = 4

_idle = threading.Event()  # set while this process sends or receives no sync's state
_idle.set()


def wait_while_transferring() -> None:
    """Block while this process sends or receives a sync's state (a transfer ends, or fails, within its timeouts)."""
    _idle.wait()


def send_tensors_(
    ring: CollectiveGroup,
    plan: SyncPlan,
    tensors: Sequence[torch.Tensor],
    chunk_bytes: int = CHUNK_BYTES,
    window: int = WINDOW,
) -> int:
    """Overwrite the receivers' `tensors` with the holders' (the same shapes and dtypes on every rank).

    Every rank of the ring calls it with the same plan; a rank that neither
    sends nor receives returns at once. Returns the bytes this rank received.
    Without point-to-point messages on this backend, rank 0 broadcasts each
    chunk to every rank instead (holders discard what they receive).
    """
    if not plan.moves_state:
        return 0
    pairs = [(t, t if t.is_contiguous() else t.contiguous()) for t in tensors if t.numel()]
    views = [c.detach().reshape(-1).view(torch.uint8) for _, c in pairs]
    p2p = ring.point_to_point
    chunks = schedule_chunks(
        [v.numel() for v in views], plan.holders if p2p else (0,), chunk_bytes, groups=[v.device for v in views]
    )
    if p2p:
        mine = [(i, s, r) for i, s, r in order_transfers(chunks, plan.receivers) if ring.rank in (s, r)]
    else:
        mine = [(i, 0, ring.rank) for i in range(len(chunks))]
    toucher = _Toucher([chunks[i] for i, _, _ in mine], views) if p2p and plan.receives else None
    _idle.clear()
    try:
        received = _exchange(ring, plan, chunks, mine, views, toucher, window * chunk_bytes)
    finally:
        _idle.set()
        if toucher is not None:
            toucher.close()  # a transfer cut short is restored next: no thread may write into it then
    if plan.receives:
        with torch.no_grad():
            for t, c in pairs:
                if c is not t:
                    t.copy_(c)
    return received


def _exchange(
    ring: CollectiveGroup,
    plan: SyncPlan,
    chunks: list[Chunk],
    mine: list[tuple[int, int, int]],
    views: list[torch.Tensor],
    toucher: _Toucher | None,
    window: int,
) -> int:
    """This rank's sends and receives of `mine`, at most `window` bytes in flight; returns the bytes it kept.

    A rank with nothing in flight always posts its next transfer, so the
    earliest unfinished one has both its ends posted and the exchange cannot
    deadlock, whatever the chunks' sizes.
    """
    p2p = ring.point_to_point
    received = bytes_in_flight = 0
    inflight: deque[tuple[CollectiveWork, Callable[[], None] | None, int]] = deque()
    with torch.no_grad():
        for k, (i, sender, receiver) in enumerate(mine):
            chunk = chunks[i]
            while inflight and bytes_in_flight + chunk.nbytes > window:
                bytes_in_flight -= _finish(inflight.popleft())
            if toucher is not None:
                toucher.wait_past(k)
            if ring.rank == sender:
                message = _pack(chunk, views)
                work = ring.send_async(message, receiver) if p2p else _broadcast(ring, message)
                inflight.append((work, None, chunk.nbytes))
            else:
                into, unpack = _landing(chunk, views, keep=plan.receives)
                work = ring.recv_async(into, sender) if p2p else _broadcast(ring, into)
                inflight.append((work, unpack, chunk.nbytes))
                received += chunk.nbytes if plan.receives else 0
            bytes_in_flight += chunk.nbytes
        while inflight:
            _finish(inflight.popleft())
    return received


class _Toucher:
    """Faults each chunk's memory in once, in receive order, on its own thread: the page faults of fresh memory.

    Where the kernel can fault a range in without writing it
    (`ray_elastic.state.pages`), the thread runs ahead of the receives
    without holding them back: a page it has not reached yet is faulted in
    by the receive itself, so both share the faults. Elsewhere it writes
    zeros, and each receive waits until its chunk was written. A piece
    already in memory (a model's initialised parameters, the optimizer state
    a newcomer prepared during its boot) is left alone.
    """

    def __init__(self, chunks: list[Chunk], views: list[torch.Tensor]) -> None:
        self.writes = not can_populate()
        self._closed = False
        self._done = 0  # chunks touched so far
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, args=(chunks, views), name="ray_elastic-touch", daemon=True)
        self._thread.start()

    def _run(self, chunks: list[Chunk], views: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for chunk in chunks:
                if self._closed:
                    return
                for p in chunk.pieces if len(chunk.pieces) == 1 else ():
                    piece = views[p.buffer][p.start : p.stop]
                    if piece.device.type != "cpu" or resident(piece):  # page faults are the host's alone
                        continue
                    if self.writes:
                        piece.zero_()
                    else:
                        populate(piece)  # a page it cannot fault in, the receive faults in itself
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()

    def wait_past(self, k: int) -> None:
        """Block until chunk `k` (in receive order) was written, so its receive never races the thread."""
        if not self.writes:
            return
        with self._cond:
            self._cond.wait_for(lambda: self._done > k)

    def close(self) -> None:
        """Stop after the chunk in hand and wait for the thread (a chunk or less: bounded)."""
        self._closed = True
        self._thread.join()


def resident(t: torch.Tensor) -> bool:
    """Whether a contiguous CPU tensor's pages are all in memory already (False where that cannot be told)."""
    return t.device.type == "cpu" and resident_range(t.data_ptr(), t.numel() * t.element_size())


def populate(t: torch.Tensor) -> bool:
    """Fault a contiguous CPU tensor's pages in, writable, without writing them; False where that is not possible."""
    if t.device.type != "cpu":
        return False
    return populate_range(t.data_ptr(), t.numel() * t.element_size())


def _pack(chunk: Chunk, views: list[torch.Tensor]) -> torch.Tensor:
    parts = [views[p.buffer][p.start : p.stop] for p in chunk.pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # one device: the plan never mixes them


def _landing(chunk: Chunk, views: list[torch.Tensor], keep: bool) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """Where a chunk is received, and how its bytes then reach the tensors (None: received in place).

    A staging buffer sits on the chunk's own device (all its pieces share one).
    """
    device = views[chunk.pieces[0].buffer].device
    if not keep:
        return torch.empty(chunk.nbytes, dtype=torch.uint8, device=device), None
    parts = [views[p.buffer][p.start : p.stop] for p in chunk.pieces]
    if len(parts) == 1:
        return parts[0], None
    staging = torch.empty(chunk.nbytes, dtype=torch.uint8, device=device)

    def unpack() -> None:
        offset = 0
        for part in parts:
            part.copy_(staging[offset : offset + part.numel()])
            offset += part.numel()

    return staging, unpack


def _broadcast(ring: CollectiveGroup, message: torch.Tensor) -> CollectiveWork:
    ring.broadcast_(message, 0)
    return CollectiveWork()


def _finish(entry: tuple[CollectiveWork, Callable[[], None] | None, int]) -> int:
    """Wait for one transfer (and unpack it); returns its bytes."""
    work, unpack, nbytes = entry
    work.wait()
    if unpack is not None:
        unpack()
    return nbytes


def broadcast_tensors_(tensors: Iterable[torch.Tensor], root_rank: int = 0) -> None:
    """Broadcast tensors in place from `root_rank`, one coalesced message per (device, dtype)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    ring = group()  # every rank holds the same tensors here: the ring's own broadcast, no cross-rank check
    root_rank = root_rank_in(root_rank, ring.size)
    with torch.no_grad():
        for same_kind in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
            ring.broadcast_(flat, root_rank)
            offset = 0
            for t in same_kind:
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
