"""`DataShard`: this rank's view of a Ray Dataset, trained exactly once per epoch through every reset.

`elastic.get_dataset_shard("train")` inside `train_fn` returns this
worker's shard of the dataset passed as `ElasticTrainer(...,
datasets={"train": ds})`. Iterating it (`iter_batches`,
`iter_torch_batches`, with Ray's keywords) hands out this rank's batch of
each step, in the lockstep order of `plan.py`, built from its rows as Ray
Data builds a batch (`batches.py`); the rows handed out count as consumed,
and a commit saves that. Put the shard in the state like a sampler:

    shard = elastic.get_dataset_shard("train", shuffle=True, seed=0)
    state = elastic.torch.TorchState(model=model, optimizer=opt, data=shard, epoch=0)

A rollback restores the committed position in place (the `shard` you hold
is the one restored), so exactly the rows consumed since the last commit
are served again; a graceful change keeps them consumed; a newcomer's sync
brings rank 0's position. This works in `TorchState` and `ObjectState`
alike, through the copy protocol both use: a copy of the shard (what a
commit keeps) is a snapshot of its position, and copying a snapshot back
(what a rollback does) loads it into the live shard and returns that. A
pickled shard (a sync, a durable checkpoint) carries its position the same
way.

The blocks come from the run's feed actor (`feed.py`), which streams the
dataset; this rank fetches the blocks its rows lie in from the object
store, those of its next `prefetch_batches` batches ahead of need
(`ray.wait(fetch_local=True)` starts the transfer while the current batch
trains), and holds references only from its position on, so the object
store can free what every rank consumed and committed.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.auth import Authed
from ray_elastic.data.batches import batch_format_of, check_iteration, concat, to_format, torch_batches
from ray_elastic.data.plan import SHUFFLE_WINDOW, BlockTable, EpochOrder, Step, step_rows
from ray_elastic.exceptions import RendezvousTimeoutError
from ray_elastic.run_footprint import run_namespace
from ray_elastic.runtime.process import current, maybe_current

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

_WAIT_S = 600.0  # the feed producing the next blocks of an epoch (reading and preprocessing included)
_ANSWER_MARGIN_S = 60.0  # the feed's own answer after its bounded wait (a restart of the feed included)
_LIVE: dict[str, DataShard] = {}  # this worker's shards, by dataset name


class DataShard:
    """This rank's shard of one of the run's datasets (see the module docstring). Not thread-safe."""

    def __init__(self, name: str, feed: Any, shuffle: bool = False, seed: int = 0, worker: Any = None) -> None:
        """`worker`: the process's `WorkerContext` whose ring rank a commit reads (None: a shard outside a run)."""
        self.name = name
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self._feed = feed
        self._worker = worker
        self.epoch = 0
        self.position = 0  # rows of this epoch handed out (to the whole world)
        self.padding_rows = 0  # repeated rows trained in this epoch's last step
        self.dropped_rows = 0  # rows not trained this epoch (drop_last)
        self._live: DataShard | None = None  # set on snapshots: the live shard they restore into
        self._saved_position: tuple[int, int] | None = None  # (epoch, position) at the last commit
        self._reset_table()

    # ---- epoch and position --------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch`: nothing consumed. Setting the epoch the shard is in changes nothing (as the sampler)."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.position, self.padding_rows, self.dropped_rows = epoch, 0, 0, 0
            self._reset_table()

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "epoch": self.epoch,
            "position": self.position,
            "padding_rows": self.padding_rows,
            "dropped_rows": self.dropped_rows,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["name"] != self.name:
            raise ValueError(f"a position of dataset {state['name']!r} cannot load into the shard of {self.name!r}")
        if (state["shuffle"], state["seed"]) != (self.shuffle, self.seed):
            raise ValueError(
                f"the position was taken with shuffle={state['shuffle']}, seed={state['seed']}; this shard has "
                f"shuffle={self.shuffle}, seed={self.seed}: the rows would not line up"
            )
        if state["epoch"] != self.epoch:
            self._reset_table()
        self.epoch, self.position = state["epoch"], state["position"]
        self.padding_rows, self.dropped_rows = state["padding_rows"], state["dropped_rows"]

    # ---- iteration -------------------------------------------------------------------------
    def iter_batches(
        self,
        batch_size: int | None = 256,
        *,
        prefetch_batches: int = 1,
        batch_format: str | None = "default",
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
    ) -> Iterator[Any]:
        """This rank's batches of the rest of the epoch, as Ray's `DataIterator.iter_batches` builds them.

        Ray's keywords and defaults (`batches.py`): `batch_format` "default"
        or "numpy" (a dict of numpy arrays), "pandas", "pyarrow", or None
        (the block as it is); `drop_last=True` drops an epoch's last step
        when it is short of `batch_size` rows per rank (its rows counted in
        `dropped_rows`); `prefetch_batches` (0: none) is how many of this
        rank's next batches are fetched into this node's object store while
        the current one trains. Refused, by name: `batch_size=None` and a
        `local_shuffle_buffer_size` (see `batches.check_iteration`);
        `local_shuffle_seed` only goes with the latter, and Ray too ignores
        it alone.
        """
        batch_size = check_iteration(batch_size, local_shuffle_buffer_size, prefetch_batches)
        batch_format = batch_format_of(batch_format)
        return self._iterate(batch_size, drop_last, prefetch_batches, lambda block: to_format(block, batch_format))

    def iter_torch_batches(
        self,
        batch_size: int | None = 256,
        *,
        prefetch_batches: int = 1,
        dtypes: Any = None,
        device: Any = "auto",
        collate_fn: Callable[[Any], Any] | None = None,
        drop_last: bool = False,
        local_shuffle_buffer_size: int | None = None,
        local_shuffle_seed: int | None = None,
        pin_memory: bool = False,
    ) -> Iterator[Any]:
        """As `iter_batches`, each batch what Ray's `DataIterator.iter_torch_batches` makes of the same rows.

        A dict of tensors per column (`dtypes`: one torch dtype, or one per
        column), or `collate_fn`'s batch (its class picks its input as in
        Ray: a `pyarrow.Table`, a DataFrame, or a dict of numpy arrays);
        tensors on `device` ("auto": this worker's GPU, else the CPU).
        `batches.py` says which columns convert, and how.
        """
        batch_size = check_iteration(batch_size, local_shuffle_buffer_size, prefetch_batches)
        convert = torch_batches(dtypes=dtypes, device=device, collate_fn=collate_fn, pin_memory=pin_memory)
        return self._iterate(batch_size, drop_last, prefetch_batches, convert)

    def _iterate(
        self, batch_size: int, drop_last: bool, prefetch_batches: int, convert: Callable[[Any], Any]
    ) -> Iterator[Any]:
        worker = self._worker if self._worker is not None else current()  # a shard rebuilt by hand: the process's
        slot = worker.joined().slot  # as rank() does: the shard is split over the current ring
        rank, size = slot.rank, slot.size
        while True:
            while True:
                try:
                    usable = self._order().usable(self._ended)
                    step = step_rows(self.position, usable, self._total(), rank, size, batch_size)
                    break
                except LookupError as need:
                    rows = need.args[0]
                self._learn_blocks(rows)  # outside the handler: a feed error is not chained to the LookupError
            if step is None:
                return
            left = step.next_position - self.position
            if drop_last and left < size * batch_size:  # Ray's drop_last: no batch short of batch_size
                step = Step((), step.next_position, 0, left)
            block = self._gather(step.ranges) if step.ranges else None
            # handed out = consumed: the next commit saves it, a rollback hands it out again
            self.position = step.next_position
            self.padding_rows += step.padding_rows
            self.dropped_rows += step.dropped_rows
            if block is None:
                return
            self._let_go_and_prefetch(rank, size * batch_size, batch_size, prefetch_batches)
            yield convert(block)

    # ---- blocks ------------------------------------------------------------------------------
    def _reset_table(self) -> None:
        self._table = BlockTable()
        self._refs: dict[int, Any] = {}  # block index -> (reference, first row), from this rank's position on
        self._blocks: dict[int, Any] = {}  # block index -> (the block, first row), fetched
        self._ended = False
        self._epoch_order: EpochOrder | None = None

    def _order(self) -> EpochOrder:
        if self._epoch_order is None or self._epoch_order.epoch != self.epoch:
            self._epoch_order = EpochOrder(self._table, self.seed, self.epoch, self.shuffle)
        return self._epoch_order

    def _total(self) -> int | None:
        return self._table.known if self._ended else None

    def _ask_feed(self, start: int) -> None:
        """Learn the table entries from block `start` on (their references and row counts)."""
        entries, ended = _get(
            self._feed.blocks.remote(self.name, self.epoch, start, _WAIT_S),
            _WAIT_S + _ANSWER_MARGIN_S,
            f"the feed actor's table of dataset {self.name!r} from block {start} (epoch {self.epoch})",
        )
        for offset, (ref, rows) in enumerate(entries):
            index = start + offset
            if index == len(self._table):
                self._table.add(rows)
            if ref is not None and index >= self._first_needed():
                self._refs[index] = ref  # held from this rank's position on only
        if ended and start + len(entries) >= len(self._table):
            self._ended = True

    def _learn_blocks(self, rows: int) -> None:
        """Wait until `rows` rows of the epoch are known or the epoch's stream ended."""
        while self._order().usable(self._ended) < rows and not self._ended:
            self._ask_feed(len(self._table))

    def _block(self, index: int) -> Any:
        if index not in self._blocks:
            for attempt in range(2):
                if index not in self._refs:  # dropped behind the position, wanted again after a rollback
                    self._refs[index] = _get(
                        self._feed.ref.remote(self.name, self.epoch, index, _WAIT_S),
                        _WAIT_S + _ANSWER_MARGIN_S,
                        f"the feed actor's reference to block {index} of dataset {self.name!r} (epoch {self.epoch})",
                    )
                ref, offset = self._refs[index]
                try:
                    what = f"block {index} of dataset {self.name!r} (epoch {self.epoch}) from the object store"
                    self._blocks[index] = (_get(ref, _WAIT_S, what), offset)
                    break
                except ray.exceptions.ObjectLostError:  # its owner, the feed, died and Ray restarted it
                    self._refs = {}  # every reference from the old feed is void: ask the new one
                    if attempt:
                        raise
        return self._blocks[index]

    def _gather(self, ranges: tuple[tuple[int, int], ...]) -> Any:
        """One block of the rows at `ranges` (epoch positions), in order (`batches.concat`)."""
        from ray.data.block import BlockAccessor

        pieces = []
        for start, end in ranges:
            for index, rows in self._order().rows(start, end):
                block, offset = self._block(index)  # the table's block `index` is rows [offset, ...) of `block`
                block = BlockAccessor.for_block(block)
                if not self.shuffle:  # one contiguous run of the block
                    pieces.append(block.slice(offset + int(rows[0]), offset + int(rows[-1]) + 1, copy=False))
                else:
                    pieces.append(block.take((offset + rows).tolist()))
        return concat(pieces)

    def _first_needed(self) -> int:
        """The first block the rest of the epoch may read: the position's, or with shuffling its window's first."""
        block = self._table.block_of(self.position)
        return block // SHUFFLE_WINDOW * SHUFFLE_WINDOW if self.shuffle else block

    def _let_go_and_prefetch(self, rank: int, world_rows: int, batch_size: int, batches: int) -> None:
        """Drop what lies before the position; start fetching the blocks of this rank's next `batches` batches.

        As Ray's `prefetch_batches`: the fetch into this node's object store
        (`ray.wait(fetch_local=True)`) runs while the current batch trains;
        only blocks the table already knows are fetched.
        """
        current = self._first_needed()
        for index in [i for i in self._blocks if i < current]:
            del self._blocks[index]
        for index in [i for i in self._refs if i < current]:
            del self._refs[index]
        usable = self._order().usable(self._ended)
        upcoming: set[int] = set()
        for k in range(max(batches, 0)):
            start = self.position + k * world_rows + rank * batch_size
            end = min(start + batch_size, usable)
            if start >= end:
                break
            upcoming.update(index for index, _ in self._order().rows(start, end))
        refs = [self._refs[i][0] for i in sorted(upcoming) if i in self._refs and i not in self._blocks]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)

    # ---- the copy protocol of TorchState / ObjectState -----------------------------------------
    def _release_committed(self, rank: int) -> None:
        """A commit: the feed may let go of the blocks before the previous commit's position (rank 0 tells it)."""
        previous, self._saved_position = self._saved_position, (self.epoch, self.position)
        if previous is None or rank != 0 or self._feed is None:
            return
        epoch, position = previous
        table = self._table if epoch == self.epoch else None
        below = table.block_of(position) if table is not None else 0
        try:
            self._feed.release.remote(self.name, self.epoch if table is not None else epoch, below)
        except Exception:  # noqa: BLE001 - a feed restarting: memory is let go at the next commit
            logger.warning("could not tell the feed which blocks of %r are committed", self.name)

    def __deepcopy__(self, memo: dict) -> DataShard:
        if self._live is not None:  # a snapshot copied back: a rollback loads it into the live shard
            self._live.load_state_dict(self.state_dict())
            return self._live
        slot = self._worker.slot if self._worker is not None else None
        if slot is not None:  # a commit in a ring (not the state's first save, before any ring)
            self._release_committed(slot.rank)
        snapshot = copy.copy(self)
        snapshot._live = self
        return snapshot

    def __copy__(self) -> DataShard:
        twin = object.__new__(DataShard)
        twin.__dict__.update(self.__dict__)
        return twin

    def __reduce__(self) -> tuple:
        return (_rebuild, (self.state_dict(), self._live is not None))

    def __repr__(self) -> str:
        kind = "snapshot of " if self._live is not None else ""
        return f"<{kind}DataShard {self.name!r} epoch {self.epoch} position {self.position}>"


def _rebuild(state: dict[str, Any], snapshot: bool) -> DataShard:
    """A pickled shard arriving: into this worker's live shard of that dataset, or a snapshot bound to it."""
    live = _LIVE.get(state["name"])
    if live is None:  # not in a worker that has the shard (e.g. read back from a checkpoint by hand)
        live = DataShard(state["name"], None, state["shuffle"], state["seed"])
        live.load_state_dict(state)
        return live
    if not snapshot:
        live.load_state_dict(state)
        return live
    copy_ = copy.copy(live)
    copy_._live = live
    copy_.load_state_dict(state)
    return copy_


def _get(ref: Any, timeout: float, what: str) -> Any:
    """`ray.get(ref)` within `timeout` s; past it, `RendezvousTimeoutError` naming `what` (not Ray's bare words)."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RendezvousTimeoutError(f"waited {timeout:g} s for {what} without an answer") from None


def get_dataset_shard(name: str, *, shuffle: bool = False, seed: int = 0) -> DataShard:
    """This worker's shard of the dataset passed as `ElasticTrainer(..., datasets={name: ds})`.

    `shuffle`: each epoch takes the blocks 4 at a time and visits the rows of
    each such window in a permutation drawn from `(seed, epoch, window)`, the
    same on every rank and after every reset (the windows come in the
    dataset's order). Every call for one name returns the same shard.
    """
    ctx = maybe_current()
    if ctx is None:
        raise RuntimeError("get_dataset_shard() only works inside train_fn running under ElasticTrainer.fit()")
    names = ctx.dataset_names
    if name not in names:
        raise KeyError(f"no dataset named {name!r}: ElasticTrainer was given datasets {sorted(names)}")
    shard = _LIVE.get(name)
    if shard is None:
        handle = ray.get_actor("feed", namespace=run_namespace(ctx.run_id))
        shard = _LIVE[name] = DataShard(name, Authed(handle, ctx.run_token), shuffle, seed, worker=ctx)
    elif (shard.shuffle, shard.seed) != (bool(shuffle), int(seed)):
        raise ValueError(
            f"the shard of {name!r} was made with shuffle={shard.shuffle}, seed={shard.seed}; "
            f"asked again with shuffle={shuffle}, seed={seed}"
        )
    return shard
