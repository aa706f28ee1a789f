"""The run's feed actor: streams each dataset's epochs and hands their blocks out, in one order for every rank.

One actor per run (named `feed` in the run's namespace, on the head node,
zero CPUs), created by `fit()` when `datasets=` is given and removed with
the run. For each (dataset, epoch) that a rank asks for, a thread runs the
dataset's streaming execution (`iter_internal_ref_bundles`, with Ray Data's
`preserve_order`, so every execution of an epoch yields the same blocks in
the same order) and appends each block's reference and row count to the
epoch's table. Ranks read the table and fetch the blocks themselves from
the object store; the actor holds references only.

Memory stays bounded: the thread stops pulling once the table runs
`ahead_blocks` past the furthest block any rank asked for, or the blocks
ahead of it take a quarter of the object store (Ray Data's own
backpressure then holds the execution), and a commit lets go of the
blocks below the position committed before it (`release`), so a dataset
larger than the object store streams through it. A block asked for after
it was let go (a rank rolled back further, or this actor restarted) is
produced again by executing the epoch once more from its start.

No wait is silent: a rank waits for a block at most `wait_s` seconds (then
`RendezvousTimeoutError` names the block and the dataset), and a pipeline
that produces nothing while the cluster has no free CPU fails the rank's
call after `data_starvation_timeout` seconds with a `DataStarvedError`
(`starvation.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.auth import Authed
from ray_elastic.data.starvation import PROBE_EVERY_S, Starvation, probe_cluster
from ray_elastic.exceptions import RendezvousTimeoutError
from ray_elastic.wire import DataSlow

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

_BATCH_OF_BLOCKS = 256  # table entries per answer
_COUNT_ROWS_S = 600.0  # fetching a block the execution just produced, to count its rows


def _count_rows(ref: Any, name: str, index: int) -> int:
    from ray.data.block import BlockAccessor

    try:
        block = ray.get(ref, timeout=_COUNT_ROWS_S)
    except ray.exceptions.GetTimeoutError:
        raise RendezvousTimeoutError(
            f"block {index} of dataset {name!r} was produced but could not be fetched from the object store "
            f"within {_COUNT_ROWS_S:g} s to count its rows"
        ) from None
    return BlockAccessor.for_block(block).num_rows()


class _Epoch:
    """One epoch of one dataset: its table of ((block reference, first row) or None once released, rows)."""

    def __init__(
        self,
        name: str,
        dataset: Any,
        ahead: int,
        budget: float,
        starvation: Starvation,
        on_slow: Callable[[str, int, float], None] | None = None,
    ) -> None:
        self.name = name
        self.dataset = dataset
        self.starvation = starvation
        self.on_slow = on_slow  # told (dataset, block, seconds) of a wait past the starvation timeout, once a block
        self._slow: set[int] = set()
        self.ahead = ahead
        self.refs: list[Any] = []
        self.rows: list[int] = []
        self.sizes: list[int] = []  # bytes of each block
        self.budget = budget  # bytes the blocks ahead of the furthest rank may take in the object store
        self.ended = False
        self.error: str | None = None
        self.wanted = 0  # the furthest block index asked for
        self.released_below = 0  # blocks below this index were let go
        self.cond = threading.Condition()
        self.produced_at = time.monotonic()  # when the execution last produced a block (or started)
        self.generation = 0  # bumped when the epoch is executed again (a released block is wanted)
        self._start()

    def _start(self) -> None:
        self.generation += 1
        threading.Thread(target=self._pull, args=(self.generation,), name="ray-elastic-feed", daemon=True).start()

    def _pull(self, generation: int) -> None:
        index = 0
        try:
            for bundle in self.dataset.iter_internal_ref_bundles():
                for entry, part in zip(bundle.blocks, bundle.slices, strict=True):
                    ref = entry.ref
                    size = entry.metadata.size_bytes or 0
                    if part is not None:  # the bundle carries rows [start, end) of the block
                        offset, rows = part.start_offset, part.num_rows
                    else:
                        offset, rows = 0, entry.metadata.num_rows
                        if rows is None:  # not measured: count them
                            rows = _count_rows(ref, self.name, index)
                    with self.cond:
                        if generation != self.generation:
                            return
                        while self._too_far(index) and generation == self.generation:
                            self.cond.wait(1.0)
                        if index < len(self.refs):
                            if self.refs[index] is None and index >= self.released_below:
                                self.refs[index] = (ref, offset)  # a re-execution refills what is wanted again
                        else:
                            self.refs.append((ref, offset))
                            self.rows.append(rows)
                            self.sizes.append(size)
                        index += 1
                        self.produced_at = time.monotonic()
                        self.cond.notify_all()
            with self.cond:
                if generation == self.generation:
                    self.ended = True
                    self.cond.notify_all()
        except Exception as e:  # noqa: BLE001 - the dataset's own error, handed to the ranks
            logger.exception("the dataset's execution failed")
            with self.cond:
                self.error = f"{type(e).__name__}: {e}"
                self.cond.notify_all()

    def _too_far(self, index: int) -> bool:
        """Whether producing block `index` now would run too far ahead: `ahead` blocks, or `budget` bytes."""
        if index <= self.wanted:
            return False
        return index > self.wanted + self.ahead or sum(self.sizes[self.wanted : index]) > self.budget

    def blocks(self, start: int, wait_s: float) -> tuple[list[tuple[Any, int]], bool]:
        """Table entries from `start` on (at least one unless the epoch ended), and whether it ended.

        An entry is ((block reference, its first row), rows); None for a block let go (`ref` gets it back).
        """
        with self.cond:
            self.wanted = max(self.wanted, start + 1)
            self.cond.notify_all()
            self._wait(lambda: start < len(self.refs) or self.ended or self.error is not None, start, wait_s)
            if self.error is not None:
                raise RuntimeError(f"the dataset's execution failed: {self.error}")
            entries = list(zip(self.refs[start : start + _BATCH_OF_BLOCKS], self.rows[start:], strict=False))
            return entries, self.ended and start + len(entries) >= len(self.refs)

    def ref(self, index: int, wait_s: float) -> Any:
        """Block `index`'s (reference, first row), produced again if let go (the epoch is executed once more)."""
        with self.cond:
            self.wanted = max(self.wanted, index + 1)
            self.cond.notify_all()
            if index < len(self.refs) and self.refs[index] is None:
                self._refill(index)
            self._wait(
                lambda: (
                    (index < len(self.refs) and self.refs[index] is not None)
                    or self.error is not None
                    or (self.ended and index >= len(self.refs))
                ),
                index,
                wait_s,
            )
            if index < len(self.refs) and self.refs[index] is not None:
                return self.refs[index]
            if self.error is not None:
                raise RuntimeError(f"the dataset's execution failed: {self.error}")
            raise IndexError(f"the epoch has {len(self.refs)} blocks, block {index} was asked for")

    def _wait(self, done: Callable[[], bool], index: int, wait_s: float) -> None:
        """Wait (holding `cond`) until `done()`, at most `wait_s` s; fail early if the pipeline is starved of CPUs.

        `cond` is held once (by `blocks` or `ref`), so releasing it around the probe lets the producer go on.
        """
        since = time.monotonic()
        while not done():
            left = since + wait_s - time.monotonic()
            if left <= 0:
                raise RendezvousTimeoutError(
                    f"block {index} of dataset {self.name!r} was not produced within {wait_s:g} s"
                )
            self.cond.wait(min(left, PROBE_EVERY_S))
            if not done():
                # the probe asks the cluster (up to seconds, `probe_cluster`): the producer must not wait for it
                self.cond.release()
                try:
                    self.starvation.check(self.name, since, self.produced_at)
                finally:
                    self.cond.acquire()
        took = time.monotonic() - since
        # as long as a starved pipeline would have failed, but it ran: slow, and said so once per block
        if took >= self.starvation.timeout and index not in self._slow and self.on_slow is not None:
            self._slow.add(index)
            self.on_slow(self.name, index, took)

    def _refill(self, start: int) -> None:
        """Blocks from `start` were let go but are wanted again: execute the epoch once more."""
        logger.warning("block %d was released and is wanted again: executing the epoch once more", start)
        self.released_below = min(self.released_below, start)
        self.ended = False
        self._start()

    def release(self, below_block: int) -> None:
        with self.cond:
            for i in range(self.released_below, min(below_block, len(self.refs))):
                self.refs[i] = None
            self.released_below = max(self.released_below, min(below_block, len(self.refs)))
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.generation += 1
            self.refs = [None] * len(self.refs)
            self.cond.notify_all()


class Feed:
    """Wrapped by `ray.remote` in `create_feed_actor`; a threaded actor."""

    _run_token: Any  # the run's token, set by `with_token_check` (auth.py)

    def __init__(
        self,
        datasets: dict[str, Any],
        data_cpus: int,
        starvation_timeout: float,
        namespace: str = "",
        ahead_blocks: int = 8,
    ) -> None:
        from ray.data import DataContext

        self._datasets = {}
        for name, dataset in datasets.items():
            context = DataContext.get_current()
            context.execution_options.preserve_order = True  # one order of blocks for every execution
            dataset.context.execution_options.preserve_order = True
            dataset.context.enable_progress_bars = False  # the feed is no terminal: the bars would fill the logs
            self._datasets[name] = dataset
        self._ahead = ahead_blocks
        # the blocks ahead of the furthest rank take at most a quarter of the object store
        self._budget = 0.25 * ray.cluster_resources().get("object_store_memory", float("inf"))
        started_ms = time.time() * 1000  # the pipeline's tasks are created from now on
        self._starvation = Starvation(starvation_timeout, data_cpus, probe=lambda: probe_cluster(since_ms=started_ms))
        self._epochs: dict[tuple[str, int], _Epoch] = {}
        self._lock = threading.Lock()
        self._namespace = namespace  # the run's, where its driver is named

    def _epoch(self, name: str, epoch: int) -> _Epoch:
        if name not in self._datasets:
            raise KeyError(f"no dataset named {name!r}; the run has {sorted(self._datasets)}")
        with self._lock:
            key = (name, epoch)
            if key not in self._epochs:
                self._epochs[key] = _Epoch(
                    name, self._datasets[name], self._ahead, self._budget, self._starvation, self._report_slow
                )
            return self._epochs[key]

    def _report_slow(self, name: str, block: int, seconds: float) -> None:
        """A block came after a long wait with its pipeline running: the driver records a `data_slow` event."""
        logger.warning("block %d of dataset %r took %.1f s to produce; its pipeline was running", block, name, seconds)
        try:
            driver = ray.get_actor("driver", namespace=self._namespace)
            Authed(driver, self._run_token).tell.remote(DataSlow(name, block, seconds))  # not awaited: a note
        except Exception:  # noqa: BLE001 - a driver restarting misses one note; training is not held for it
            logger.warning("could not tell the run's driver that dataset %r is slow", name, exc_info=True)

    def blocks(self, name: str, epoch: int, start: int, wait_s: float) -> tuple[list[tuple[Any, int]], bool]:
        return self._epoch(name, epoch).blocks(start, wait_s)

    def ref(self, name: str, epoch: int, index: int, wait_s: float) -> Any:
        return self._epoch(name, epoch).ref(index, wait_s)

    def release(self, name: str, epoch: int, below_block: int) -> None:
        """A commit made blocks below `below_block` of `epoch` unneeded, and every older epoch."""
        with self._lock:
            old = [key for key in self._epochs if key[0] == name and key[1] < epoch]
            for key in old:
                self._epochs.pop(key).stop()
            current = self._epochs.get((name, epoch))
        if current is not None:
            current.release(below_block)

    def names(self) -> list[str]:
        return sorted(self._datasets)


def create_feed_actor(
    namespace: str,
    token: Any,
    datasets: dict[str, Any],
    scheduling_strategy: Any,
    data_cpus: int,
    starvation_timeout: float,
) -> Any:
    """Start the run's feed actor, named `feed` in the run's namespace; it answers only calls carrying `token`.

    `data_cpus` and `starvation_timeout` are the run's options, for the starvation check (`starvation.py`).
    """
    from ray_elastic.auth import Authed, with_token_check

    cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(with_token_check(Feed))
    handle = cls.options(
        name="feed", namespace=namespace, max_concurrency=64, scheduling_strategy=scheduling_strategy
    ).remote(token, datasets, data_cpus, starvation_timeout, namespace)
    return Authed(handle, token)
