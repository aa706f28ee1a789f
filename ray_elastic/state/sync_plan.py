"""Who holds the commit every rank resumes from, and which bytes go from whom to whom.

Pure logic, no collective: `ray_elastic.state.transfer` and
`ray_elastic.torch.broadcast` carry the plans out.

- Every commit carries a `CommitId` (`runtime/commits.py`); comparing
  63-bit fingerprints of the ids (one tiny allreduce) tells a reset which
  ranks already hold rank 0's commit.
- `plan_sync` turns the fingerprints into a `SyncPlan`: the holders (rank 0
  first) and the receivers. After a failure with no newcomer, nobody receives.
- `schedule_chunks` cuts the state's bytes into chunks of bounded size (a
  piece of one large tensor, or several small tensors of one device packed:
  a chunk never mixes devices, since a GPU's and the host's tensors cannot
  be concatenated into one message) and spreads them over the holders in
  contiguous runs; `order_transfers` lists the
  sends in one global order, which every rank follows with a bounded window
  of operations in flight (the earliest unfinished transfer always has both
  ends posted, so the exchange cannot deadlock).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence


@dataclass(frozen=True)
class SyncPlan:
    """Rank 0's commit is the one every rank resumes from; the holders already have it."""

    rank: int
    holders: tuple[int, ...]
    receivers: tuple[int, ...]

    @property
    def receives(self) -> bool:
        return self.rank in self.receivers

    @property
    def moves_state(self) -> bool:
        return bool(self.receivers)


def plan_sync(fingerprints: Sequence[int], rank: int) -> SyncPlan:
    """The ranks whose commit fingerprint equals rank 0's hold it; the others receive it."""
    if not fingerprints:
        raise ValueError("a sync needs at least rank 0's fingerprint")
    root = fingerprints[0]
    holders = tuple(r for r, f in enumerate(fingerprints) if f == root)
    receivers = tuple(r for r, f in enumerate(fingerprints) if f != root)
    return SyncPlan(rank, holders, receivers)


@dataclass(frozen=True)
class Piece:
    """Bytes `[start, stop)` of buffer number `buffer`."""

    buffer: int
    start: int
    stop: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Chunk:
    """One message: consecutive pieces (one piece of a large buffer, or several small buffers), from `sender`."""

    sender: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def schedule_chunks(
    sizes: Sequence[int],
    senders: Sequence[int],
    chunk_bytes: int,
    direct_bytes: int | None = None,
    groups: Sequence[Hashable] | None = None,
) -> list[Chunk]:
    """Cut buffers of `sizes` bytes, in order, into chunks of at most `chunk_bytes`, spread over `senders`.

    A buffer of at least `direct_bytes` (default `chunk_bytes // 16`) travels
    in chunks of its own, sent from and received into its memory; the smaller
    ones are packed together, ahead of the large ones, each with buffers of
    its own group only (`groups[i]`: buffer i's device; default one group).
    Only equality of the keys counts, so ranks whose devices differ by index
    (`cuda:0` here, `cuda:1` there) cut the same chunks. Sender k sends the
    chunks that start in the k-th of `len(senders)` equal shares of the
    bytes, so each sender reads one contiguous run of the state.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    if not senders:
        raise ValueError("a transfer needs at least one sender")
    if groups is not None and len(groups) != len(sizes):
        raise ValueError(f"{len(groups)} group keys for {len(sizes)} buffers")
    direct = min(chunk_bytes, max(1, chunk_bytes // 16) if direct_bytes is None else direct_bytes)
    # the small buffers first, packed per group: one message for all of a device's, not one between every two
    # large ones
    pieces_per_chunk: list[list[Piece]] = []
    packing: dict[Hashable, tuple[list[Piece], int]] = {}  # group -> (its open pack, the room left in it)
    for index, size in enumerate(sizes):
        if 0 < size < direct:
            key = None if groups is None else groups[index]
            packed, room = packing.get(key, ([], chunk_bytes))
            if size > room:
                pieces_per_chunk.append(packed)
                packed, room = [], chunk_bytes
            packed.append(Piece(index, 0, size))
            packing[key] = (packed, room - size)
    pieces_per_chunk.extend(packed for packed, _ in packing.values())
    for index, size in enumerate(sizes):
        if size >= direct:
            pieces_per_chunk.extend(
                [Piece(index, start, min(size, start + chunk_bytes))] for start in range(0, size, chunk_bytes)
            )
    total = sum(sizes)
    chunks, start = [], 0
    for pieces in pieces_per_chunk:
        share = min(len(senders) - 1, start * len(senders) // total) if total else 0
        chunk = Chunk(senders[share], tuple(pieces))
        chunks.append(chunk)
        start += chunk.nbytes
    return chunks


def order_transfers(chunks: Sequence[Chunk], receivers: Sequence[int]) -> list[tuple[int, int, int]]:
    """Every (chunk index, sender, receiver) of the exchange, in the one order all ranks follow.

    The senders' runs are interleaved (each sender's first chunk, then each
    one's second ...), so a receiver draws from all senders at once.
    """
    runs: dict[int, list[int]] = {}
    for i, chunk in enumerate(chunks):
        runs.setdefault(chunk.sender, []).append(i)
    order = []
    for step in range(max((len(r) for r in runs.values()), default=0)):
        for run in runs.values():
            if step < len(run):
                i = run[step]
                order.extend((i, chunks[i].sender, r) for r in receivers)
    return order
