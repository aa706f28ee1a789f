"""`ElasticSampler`: every index of an epoch is trained exactly once, across any resets.

Its one job is bookkeeping: which indices of the current epoch are processed,
so that after a failure (rollback to the last commit), a graceful add or
removal of workers, or any change of world size, the next iteration hands out
exactly the indices not yet processed, split evenly over the new world.
Horovod's `ElasticSampler` loses samples when nodes drop (#3143) and retrains
them after a graceful shutdown (#3399), because each rank remembers only what
it processed itself and rank 0's memory is what survives a sync.

The lockstep argument. In synchronous data-parallel training every rank takes
its batch `i` at the same step, so after `record_batch(i, batch_size)` on one
rank, batch `i` is done on every rank. Each rank therefore marks batch `i` of
the whole world: the global positions `[size*i*bs, size*(i+1)*bs)` of the
iteration's list, of which rank `r` iterated `list[r::size]`. Every rank then
holds the same processed set without communication, a dead rank's progress is
known to the survivors, and a commit or a sync from rank 0 carries all of it.
Users whose ranks do not step in lockstep call `record_indices` instead, which
marks only this rank's indices and raises `needs_union`: the state handler
then ORs the bitmaps across ranks (in place on `bitmap`) before it saves or
syncs.

Passes. A pass is one iteration that ran to its end: `end_pass()` (what
`prepare_data_loader`'s loader calls when its loop comes back after the last
batch) marks it complete, and the next `__iter__` in the same epoch starts a
whole new pass, as torch's `DistributedSampler` does (an evaluation loader
iterated every epoch without `set_epoch`). The mark is part of the state, so
a commit taken after the pass keeps it; a pass cut by a rollback has no mark
and resumes exactly where its last commit left it.

The processed set is a packed bitmap (`np.packbits` layout: bit `i` stands
for dataset index `i`): 10 million samples cost 1.25 MB. The epoch's order is
recomputed from `(seed, epoch)` at every iteration, never stored in the state.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import Sampler

from ray_elastic.runtime.process import current

if TYPE_CHECKING:
    from collections.abc import Iterator, Sized

# popcount of every byte value, to count set bits without unpacking the bitmap
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)
# indices are yielded as Python ints in chunks: no 10-million-element list of ints
_YIELD_CHUNK = 4096


@dataclass(frozen=True)
class _Iteration:
    """One `__iter__`'s split: what `record_batch` positions refer to."""

    padded: np.ndarray  # remaining indices in epoch order, padded or cut to a multiple of size
    num_real: int  # positions >= num_real are padding (duplicates of the first indices)
    rank: int
    size: int
    num_dropped: int


class ElasticSampler(Sampler[int]):
    """Hands each rank its share of the epoch's unprocessed indices; remembers what was processed.

    Args:
        dataset: anything with `__len__`; only its length is read, once, at construction.
        shuffle: iterate in the order `np.random.default_rng(seed + epoch).permutation(n)`
            (identical on every rank); otherwise in `0..n-1`. Default True.
        seed: non-negative int, combined with the epoch. Default 0.
        drop_last: cut the tail of the remaining indices so they divide evenly by the world
            size (those are not trained this iteration; `num_dropped` counts them) instead of
            padding with repeats of the first indices (`padding_trained` counts those trained).
            Default False.

    Limits: `record_batch` assumes lockstep, the same `batch_size` as the DataLoader's, and a
    DataLoader that does not drop its own last batch. Every rank must call `__iter__` with the
    same processed set and world size (true after a sync and after lockstep `record_batch`).
    The world comes from `set_world`, or else from `ray_elastic.rank()`/`size()` at each
    `__iter__` and `__len__`.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__()
        if not hasattr(dataset, "__len__"):
            raise TypeError(f"ElasticSampler needs a dataset with __len__, got {type(dataset).__name__}")
        self._n = len(dataset)
        self._seed = _non_negative_int(seed, "seed")
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last)
        self._epoch = 0
        self._bitmap = np.zeros((self._n + 7) // 8, dtype=np.uint8)
        self._padding_trained = 0
        self._needs_union = False
        self._world: tuple[int, int] | None = None
        self._iteration: _Iteration | None = None
        # a batch being trained, counted once it is done (hold_batch); void once its iteration ended
        self._pending: tuple[int, int] | None = None
        self._complete = False  # the epoch's last pass ran to its end: the next __iter__ starts a whole one

    # ---- world and epoch -----------------------------------------------------------------

    def set_world(self, rank: int, size: int) -> None:
        """Iterate as `rank` of `size` from the next `__iter__` on (instead of asking `ray_elastic`)."""
        size = operator.index(size)
        rank = operator.index(rank)
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size and size >= 1, got rank={rank}, size={size}")
        self._world = (rank, size)
        self._iteration = None

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch`: nothing processed, no padding trained, a new order if shuffling.

        Setting the epoch the sampler is already in changes nothing, so the usual
        `sampler.set_epoch(epoch)` at the top of the epoch loop does not throw away
        the progress restored after a reset.
        """
        epoch = _non_negative_int(epoch, "epoch")
        if epoch == self._epoch:
            return
        self._epoch = epoch
        self._start_pass()

    # ---- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """This rank's share of the unprocessed indices, in epoch order.

        Computed now (not at the first `next`), so `record_batch` refers to this split.
        After a complete pass (`end_pass`) the share is of the whole epoch again.
        """
        if self._complete:
            self._start_pass()
        rank, size = self._current_world()
        order = self._epoch_order()
        processed = np.unpackbits(self._bitmap, count=self._n).view(bool)
        remaining = order[~processed[order]]
        num_real = len(remaining)
        if self._drop_last:
            num_dropped = num_real % size
            num_real -= num_dropped
            padded = remaining[:num_real]
        else:
            num_dropped = 0
            padded = np.concatenate([remaining, np.resize(remaining, (-num_real) % size)])
        self._iteration = _Iteration(padded, num_real, rank, size, num_dropped)
        self._pending = None
        return _yield_ints(padded[rank::size])

    def __len__(self) -> int:
        """How many indices this rank yields in the current iteration (or the next one, if none is current)."""
        if self._iteration is not None:
            return len(self._iteration.padded) // self._iteration.size
        _, size = self._current_world()
        remaining = self._n if self._complete else self.num_remaining
        return remaining // size if self._drop_last else -(-remaining // size)

    # ---- recording progress --------------------------------------------------------------

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch `batch_idx` of the current iteration processed on every rank (lockstep).

        Marks the global positions `[size*batch_idx*batch_size, size*(batch_idx+1)*batch_size)`
        of the iteration's list; positions that are padding count in `padding_trained`.
        Call it once per batch, with the DataLoader's batch size, after the optimizer step.
        """
        batch_idx = operator.index(batch_idx)
        batch_size = operator.index(batch_size)
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if batch_idx < 0:
            raise ValueError(f"batch_idx must be >= 0, got {batch_idx}")
        it = self._iteration
        if it is None:
            raise RuntimeError(
                "record_batch() needs a current iteration: iterate the sampler (or the DataLoader) first; "
                "set_epoch, set_world and load_state_dict end the current one"
            )
        start = it.size * batch_idx * batch_size
        total = len(it.padded)
        if start >= total:
            raise ValueError(
                f"batch {batch_idx} of size {batch_size} starts past this iteration's "
                f"{total // it.size} indices per rank: is batch_size the DataLoader's?"
            )
        stop = min(start + it.size * batch_size, total)
        if start < it.num_real:
            _set_bits(self._bitmap, it.padded[start : min(stop, it.num_real)])
        self._padding_trained += max(0, stop - max(start, it.num_real))

    def hold_batch(self, batch_idx: int, batch_size: int) -> None:
        """Batch `batch_idx` is being trained: it counts (as `record_batch`) at the next `hold_batch` or commit.

        What `prepare_data_loader`'s loader calls as it hands out each batch:
        the loop asking for the next batch, or a commit after the step
        (`record_pending`), means the batch was trained; a rollback before
        either leaves it unprocessed.
        """
        self.record_pending()
        self._pending = (operator.index(batch_idx), operator.index(batch_size))

    def record_pending(self) -> None:
        """Count the batch `hold_batch` holds, if any (a commit calls it through the state handler)."""
        pending, self._pending = self._pending, None
        if pending is not None and self._iteration is not None:
            self.record_batch(*pending)

    def end_pass(self) -> None:
        """The current iteration ran to its end: the next `__iter__` of this epoch hands out a whole pass.

        Call it when the loop came back after the last batch (after the last
        `record_batch`); `prepare_data_loader`'s loader does. Without a current
        iteration (none started, or a `set_epoch`, `set_world` or
        `load_state_dict` ended it) it does nothing.
        """
        self.record_pending()
        if self._iteration is not None:
            self._complete = True
            self._iteration = None

    def record_indices(self, indices: Any) -> None:
        """Mark dataset indices processed on this rank only, and raise `needs_union`.

        For training that is not lockstep. The other ranks learn of these indices only
        when the state handler ORs the bitmaps (`bitmap`, `union_`) at the next commit or sync.
        """
        idx = self._checked_indices(indices)
        if idx.size:
            _set_bits(self._bitmap, idx)
            self._needs_union = True

    def is_processed(self, indices: Any) -> np.ndarray:
        """Boolean array, shaped like `indices`: which of these dataset indices are processed."""
        idx = self._checked_indices(indices)
        bits = self._bitmap[idx >> 3] & (np.uint8(0x80) >> (idx & 7).astype(np.uint8))
        return (bits != 0).reshape(np.shape(indices))

    def union_(self, other_bitmap: np.ndarray) -> None:
        """OR another rank's `bitmap` (same epoch, same dataset) into this one, in place."""
        other = np.asarray(other_bitmap)
        if other.dtype != np.uint8 or other.shape != self._bitmap.shape:
            raise ValueError(
                f"union_ needs a uint8 bitmap of shape {self._bitmap.shape}, got {other.dtype} {other.shape}"
            )
        np.bitwise_or(self._bitmap, other, out=self._bitmap)

    # ---- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything that defines the progress of the epoch; the bitmap is a copy."""
        return {
            "n": self._n,
            "epoch": self._epoch,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "bitmap": self._bitmap.copy(),
            "padding_trained": self._padding_trained,
            "needs_union": self._needs_union,
            "complete": self._complete,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Return exactly to `state_dict` (a commit, or rank 0's state in a sync).

        The bitmap is copied into the existing buffer. The current iteration ends:
        the next `__iter__` splits what remains over the world of that moment.
        """
        n = state_dict["n"]
        if n != self._n:
            raise ValueError(f"state_dict is for a dataset of {n} samples, this sampler's has {self._n}")
        bitmap = np.asarray(state_dict["bitmap"])
        if bitmap.dtype != np.uint8 or bitmap.shape != self._bitmap.shape:
            raise ValueError(
                f"state_dict bitmap must be uint8 of shape {self._bitmap.shape}, got {bitmap.dtype} {bitmap.shape}"
            )
        np.copyto(self._bitmap, bitmap)
        self._epoch = _non_negative_int(state_dict["epoch"], "epoch")
        self._seed = _non_negative_int(state_dict["seed"], "seed")
        self._shuffle = bool(state_dict["shuffle"])
        self._drop_last = bool(state_dict["drop_last"])
        self._padding_trained = int(state_dict["padding_trained"])
        self._needs_union = bool(state_dict["needs_union"])
        self._complete = bool(state_dict.get("complete", False))  # absent from states saved before passes
        self._iteration = None

    # ---- read-only views -----------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def num_processed(self) -> int:
        """Distinct indices of this epoch processed so far."""
        return int(_POPCOUNT[self._bitmap].sum(dtype=np.int64))

    @property
    def num_remaining(self) -> int:
        return self._n - self.num_processed

    @property
    def padding_trained(self) -> int:
        """Padding positions trained this epoch: the only duplicates (always 0 with drop_last)."""
        return self._padding_trained

    @property
    def num_dropped(self) -> int:
        """Indices the current iteration leaves out to divide evenly (drop_last); 0 with no current iteration."""
        return self._iteration.num_dropped if self._iteration is not None else 0

    @property
    def bitmap(self) -> np.ndarray:
        """The live processed set, `np.packbits` layout: C-contiguous, writable, for an in-place OR-allreduce."""
        return self._bitmap

    @property
    def needs_union(self) -> bool:
        """True after `record_indices`: the bitmaps differ across ranks until the handler ORs them.

        The handler sets it back to False once every rank holds the OR of all bitmaps.
        """
        return self._needs_union

    @needs_union.setter
    def needs_union(self, value: bool) -> None:
        self._needs_union = bool(value)

    # ---- internals -----------------------------------------------------------------------

    def _start_pass(self) -> None:
        """Nothing of the epoch processed: a whole pass (a new epoch's, or the next after a complete one)."""
        self._bitmap[:] = 0
        self._padding_trained = 0
        self._needs_union = False
        self._complete = False
        self._iteration = None
        self._pending = None

    def _current_world(self) -> tuple[int, int]:
        if self._world is not None:
            return self._world
        slot = current().joined().slot  # as ray_elastic.rank() and size() find it
        return slot.rank, slot.size

    def _epoch_order(self) -> np.ndarray:
        dtype = np.int32 if self._n < 2**31 else np.int64
        order = np.arange(self._n, dtype=dtype)
        if self._shuffle:
            # shuffling arange in place draws the same permutation as permutation(n), in half the memory
            np.random.default_rng(self._seed + self._epoch).shuffle(order)
        return order

    def _checked_indices(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.size == 0:
            return idx.astype(np.int64).ravel()
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
        idx = idx.ravel()
        low, high = int(idx.min()), int(idx.max())
        if low < 0 or high >= self._n:
            raise IndexError(f"indices must lie in [0, {self._n}), got values from {low} to {high}")
        return idx


def _set_bits(bitmap: np.ndarray, indices: np.ndarray) -> None:
    # bitwise_or.at, not fancy-index assignment: several indices may share a byte
    np.bitwise_or.at(bitmap, indices >> 3, np.uint8(0x80) >> (indices & 7).astype(np.uint8))


def _yield_ints(indices: np.ndarray) -> Iterator[int]:
    for start in range(0, len(indices), _YIELD_CHUNK):
        yield from indices[start : start + _YIELD_CHUNK].tolist()


def _non_negative_int(value: Any, what: str) -> int:
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value
