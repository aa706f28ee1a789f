"""Which rows of an epoch each rank takes at each step: pure arithmetic, no Ray.

An epoch of a dataset is one sequence of rows: its blocks in the order the
streaming execution produces them (Ray Data's `preserve_order`), and, when
shuffling, each block's rows in a permutation drawn from `(seed, epoch,
block index)`. The shard's whole progress is one number, `position`: the
rows `[0, position)` of that sequence are consumed.

The lockstep argument is the sampler's (`torch/sampler.py`): in synchronous
data-parallel training every rank takes its batch at the same step, so a
step consumes `size * batch_size` rows at once, rank `r` taking the `r`-th
slice. Every rank advances the same `position` without talking to the
others, a rollback restores it, a sync hands rank 0's to newcomers, and a
new world size simply splits what is left differently: every row exactly
once per epoch, whatever the membership does.

The last step of an epoch may find fewer than `size * batch_size` rows
left. By default each rank still gets an equal batch of `ceil(left /
size)` rows, the missing ones repeated from that last step's own rows
(counted in `padding_rows`), so no rank sits a step out. (`drop_last=True`
is the shard's: it skips such a step whole, as Ray drops an incomplete
batch, see `shard.py`.)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Step:
    """One rank's rows of one step, in epoch-order positions, and how the step moves the epoch."""

    ranges: tuple[tuple[int, int], ...]  # half-open position ranges, in the order the batch takes them
    next_position: int
    padding_rows: int  # repeated rows the whole world trains in this step
    dropped_rows: int = 0  # rows the whole world skips in this step (the shard's drop_last)


def step_rows(position: int, known: int, total: int | None, rank: int, size: int, batch_size: int) -> Step | None:
    """The rows of `rank`'s next batch, or None if the epoch is over.

    `known` rows of the epoch exist so far; `total` is the epoch's length
    once the stream ended (None before). Raises `LookupError` if more rows
    must be known first (the caller waits for the stream, then asks again).
    """
    full = size * batch_size
    if total is None and known < position + full:
        raise LookupError(position + full)  # how many rows must be known
    left = full if total is None else total - position
    if left <= 0:
        return None
    if left >= full:
        start = position + rank * batch_size
        return Step(((start, start + batch_size),), position + full, 0)
    per = -(-left // size)
    ranges = []
    for p in range(position + rank * per, position + (rank + 1) * per):
        at = position + (p - position) % left  # past the end: the step's own rows again
        if ranges and ranges[-1][1] == at:
            ranges[-1] = (ranges[-1][0], at + 1)
        else:
            ranges.append((at, at + 1))
    return Step(tuple(ranges), position + left, per * size - left, 0)


class BlockTable:
    """The epoch's blocks as known so far: their row counts and where each starts in the epoch."""

    def __init__(self) -> None:
        self.starts: list[int] = []  # the position of each block's first row
        self.rows: list[int] = []
        self.known = 0

    def add(self, num_rows: int) -> None:
        self.starts.append(self.known)
        self.rows.append(num_rows)
        self.known += num_rows

    def __len__(self) -> int:
        return len(self.rows)

    def pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """`(block index, first row, end row)` within each block that positions `[start, end)` cover."""
        if not 0 <= start <= end <= self.known:
            raise IndexError(f"rows [{start}, {end}) are outside the {self.known} known rows")
        out = []
        index = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            block_start = self.starts[index]
            stop = min(end, block_start + self.rows[index])
            if stop > start:
                out.append((index, start - block_start, stop - block_start))
            start = stop
            index += 1
        return out

    def block_of(self, position: int) -> int:
        """The index of the block holding `position` (the number of blocks if it is past the known rows)."""
        if position >= self.known:
            return len(self.rows)
        return bisect.bisect_right(self.starts, position) - 1


SHUFFLE_WINDOW = 4  # blocks whose rows one shuffled stretch of the epoch mixes


class EpochOrder:
    """Which block row stands at each position of an epoch: the table's rows in order, or shuffled by windows.

    With `shuffle`, the blocks are taken `window` at a time and the rows of
    each window are visited in a permutation drawn from `(seed, epoch,
    window index)`: rows mix across neighbouring blocks as well as within
    them, the same on every rank and after every reset. A window is usable
    once all its blocks are known (or the epoch's stream ended), so a rank
    holds at most `window` blocks of it at a time.
    """

    def __init__(self, table: BlockTable, seed: int, epoch: int, shuffle: bool, window: int = SHUFFLE_WINDOW) -> None:
        self.table = table
        self.seed = seed
        self.epoch = epoch
        self.shuffle = shuffle
        self.window = window
        self._orders: dict[int, np.ndarray] = {}

    def usable(self, ended: bool) -> int:
        """How many positions can be served now."""
        if ended or not self.shuffle:
            return self.table.known
        whole = len(self.table) // self.window * self.window
        return self.table.starts[whole] if whole < len(self.table) else self.table.known

    def rows(self, start: int, end: int) -> list[tuple[int, np.ndarray]]:
        """`(block index, rows of that block)` for positions `[start, end)`, grouped by block, in block order."""
        if not self.shuffle:
            return [(index, np.arange(first, stop)) for index, first, stop in self.table.pieces(start, end)]
        picked: dict[int, list[np.ndarray]] = {}
        position = start
        while position < end:
            w = self.table.block_of(position) // self.window
            first_block = w * self.window
            last_block = min(first_block + self.window, len(self.table))
            base = self.table.starts[first_block]
            limit = self.table.starts[last_block] if last_block < len(self.table) else self.table.known
            stop = min(end, limit)
            order = self._order(w, limit - base)[position - base : stop - base] + base  # positions in the window
            blocks = np.searchsorted(np.asarray(self.table.starts[first_block:last_block]), order, side="right") - 1
            for b in np.unique(blocks):
                index = first_block + int(b)
                picked.setdefault(index, []).append(order[blocks == b] - self.table.starts[index])
            position = stop
        return [(index, np.concatenate(parts)) for index, parts in sorted(picked.items())]

    def _order(self, w: int, rows: int) -> np.ndarray:
        if w not in self._orders or len(self._orders[w]) != rows:
            self._orders = {k: v for k, v in self._orders.items() if k >= w - 1}  # keep the current and the last
            self._orders[w] = np.random.default_rng([self.seed, self.epoch, w]).permutation(rows)
        return self._orders[w]
