"""Unit tests for `ElasticSampler`: exactly-once processing across resets, without Ray.

A small simulator (`SimulatedJob`) drives one sampler per rank in lockstep, as
synchronous data-parallel training does, and models the run loop's semantics:
a commit saves every rank's state (and what the model has learned so far); a
failure rolls the survivors back to the commit; a graceful change keeps the
live state; after either, every rank (newcomers too) loads rank 0's state and
iterates as a member of the new world.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from ray_elastic.torch.sampler import ElasticSampler


class SimulatedJob:
    """One sampler per rank, trained in lockstep; `trained` counts what the model has learned."""

    def __init__(
        self, n: int, batch_size: int, size: int, shuffle: bool = True, drop_last: bool = False, epoch: int = 0
    ) -> None:
        self.n, self.batch_size = n, batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.ranks = [self._newcomer() for _ in range(size)]
        self.ranks[0].set_epoch(epoch)  # the others learn the epoch from rank 0's state at the first sync
        self.trained: Counter[int] = Counter()
        self.max_size = size
        self._regroup(list(range(size)), size)

    def _newcomer(self) -> ElasticSampler:
        return ElasticSampler(range(self.n), shuffle=self.shuffle, seed=7, drop_last=self.drop_last)

    def start_iteration(self) -> list[list[int]]:
        """Every rank iterates its sampler, as a fresh DataLoader iterator does after each reset."""
        self.shards = [list(s) for s in self.ranks]
        assert len({len(shard) for shard in self.shards}) == 1, "ranks must take the same number of steps"
        self.num_batches = -(-len(self.shards[0]) // self.batch_size)
        return self.shards

    def train_batch(self, b: int) -> None:
        for shard in self.shards:
            self.trained.update(shard[b * self.batch_size : (b + 1) * self.batch_size])
        for sampler in self.ranks:
            sampler.record_batch(b, self.batch_size)

    def commit(self) -> None:
        self.committed = [s.state_dict() for s in self.ranks]
        self.trained_at_commit = self.trained.copy()

    def fail(self, survivors: list[int], new_size: int) -> None:
        """Ranks not in `survivors` die: the survivors roll back to the last commit, and so does the model."""
        for r in survivors:
            self.ranks[r].load_state_dict(self.committed[r])
        self.trained = self.trained_at_commit.copy()
        self._regroup(survivors, new_size)

    def graceful(self, survivors: list[int], new_size: int) -> None:
        """Ranks not in `survivors` leave on notice, newcomers join: no rollback."""
        self._regroup(survivors, new_size)

    def _regroup(self, survivors: list[int], new_size: int) -> None:
        kept = [self.ranks[r] for r in survivors]
        self.ranks = kept + [self._newcomer() for _ in range(new_size - len(kept))]
        rank0 = self.ranks[0].state_dict()
        for rank, sampler in enumerate(self.ranks):
            sampler.load_state_dict(rank0)
            sampler.set_world(rank, new_size)
        self.max_size = max(self.max_size, new_size)
        self.commit()  # the run loop saves on a graceful change, and sync makes rank 0's saved state everyone's

    def finish_epoch(self, commit_every: int = 1) -> None:
        self.start_iteration()
        for b in range(self.num_batches):
            self.train_batch(b)
            if (b + 1) % commit_every == 0:
                self.commit()

    def assert_epoch_done_exactly_once(self) -> None:
        rank0 = self.ranks[0]
        assert all(list(s) == [] for s in self.ranks), "a finished epoch must yield nothing more"
        assert len({s.state_dict()["bitmap"].tobytes() for s in self.ranks}) == 1
        duplicates = sum(count - 1 for count in self.trained.values())
        assert duplicates == rank0.padding_trained, "only padding may be trained twice, and it is counted"
        assert rank0.padding_trained < self.max_size
        untrained = self.n - len(self.trained)
        if self.drop_last:
            assert rank0.padding_trained == 0
            assert untrained == rank0.num_remaining == rank0.num_dropped
            assert untrained < len(self.ranks)
        else:
            assert untrained == 0, f"indices never trained: {sorted(set(range(self.n)) - set(self.trained))}"
            assert rank0.num_processed == self.n


# ---- any sequence of resets ------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 500),
    batch_size=st.integers(1, 16),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    first_size=st.integers(1, 8),
    commit_every=st.integers(1, 5),
    epoch=st.integers(0, 3),
    data=st.data(),
)
def test_every_index_is_trained_exactly_once_across_any_resets(
    n, batch_size, shuffle, drop_last, first_size, commit_every, epoch, data
):
    job = SimulatedJob(n, batch_size, first_size, shuffle=shuffle, drop_last=drop_last, epoch=epoch)
    step = 0
    for _ in range(data.draw(st.integers(0, 6), label="resets")):
        job.start_iteration()
        for b in range(data.draw(st.integers(0, job.num_batches), label="reset before batch")):
            job.train_batch(b)
            step += 1
            if step % commit_every == 0:
                job.commit()
        new_size = data.draw(st.integers(1, 8), label="new world size")
        order = data.draw(st.permutations(range(len(job.ranks))), label="survivors' new rank order")
        survivors = list(order[: data.draw(st.integers(1, min(len(job.ranks), new_size)), label="survivors")])
        if data.draw(st.booleans(), label="killed (else graceful)"):
            job.fail(survivors, new_size)
        else:
            job.graceful(survivors, new_size)
    job.finish_epoch(commit_every)
    job.assert_epoch_done_exactly_once()
    assert all(s.epoch == epoch for s in job.ranks), "newcomers must take the epoch from rank 0"


# ---- Horovod's open bugs, as regressions -------------------------------------------------


def test_horovod_3143_nodes_dropping_lose_no_samples_and_retrain_none_committed():
    job = SimulatedJob(n=96, batch_size=4, size=4)
    shards = job.start_iteration()  # 24 indices per rank, 6 batches
    for b in range(2):
        job.train_batch(b)
    job.commit()
    for b in range(2, 4):
        job.train_batch(b)  # trained, recorded, never committed

    dead_committed = {i for r in (2, 3) for i in shards[r][:8]}
    dead_uncommitted = [i for r in (2, 3) for i in shards[r][8:16]]
    committed = {i for shard in shards for i in shard[:8]}
    job.fail(survivors=[0, 1], new_size=2)  # ranks 2 and 3 die with their hosts

    new_shards = job.start_iteration()
    handed_out = Counter(i for shard in new_shards for i in shard)
    assert not dead_committed & set(handed_out), "committed batches of the dead ranks were handed out again"
    assert all(handed_out[i] == 1 for i in dead_uncommitted), (
        "uncommitted batches of the dead ranks must come back once"
    )
    assert set(handed_out) == set(range(96)) - committed
    for b in range(job.num_batches):
        job.train_batch(b)
    job.assert_epoch_done_exactly_once()
    assert job.ranks[0].padding_trained == 0 and len(job.trained) == 96


def test_horovod_3399_graceful_shutdown_does_not_retrain_the_leavers_samples():
    job = SimulatedJob(n=120, batch_size=5, size=4)
    shards = job.start_iteration()  # 30 indices per rank, 6 batches
    for b in range(3):
        job.train_batch(b)  # nothing committed since the start
    leaver_processed = set(shards[3][:15])
    processed = {i for shard in shards for i in shard[:15]}
    job.graceful(survivors=[0, 1, 2], new_size=3)  # rank 3's host announced for removal

    new_shards = job.start_iteration()
    handed_out = [i for shard in new_shards for i in shard]
    assert not leaver_processed & set(handed_out), "the leaver's processed samples were handed out again"
    assert sorted(handed_out) == sorted(set(range(120)) - processed)
    for b in range(job.num_batches):
        job.train_batch(b)
    job.assert_epoch_done_exactly_once()
    assert set(job.trained.values()) == {1}


def test_a_rank_that_records_a_batch_knows_every_ranks_batch_without_talking():
    samplers = [ElasticSampler(range(40), seed=3) for _ in range(4)]
    shards = []
    for rank, s in enumerate(samplers):
        s.set_world(rank, 4)
        shards.append(list(s))
    samplers[0].record_batch(0, 3)
    first_batches = [i for shard in shards for i in shard[:3]]
    assert samplers[0].is_processed(first_batches).all()
    assert samplers[0].num_processed == 12
    assert not samplers[0].is_processed([i for shard in shards for i in shard[3:]]).any()


# ---- order, padding, drop_last -----------------------------------------------------------


def test_epoch_order_is_the_seeded_permutation_and_the_same_on_every_rank():
    s = ElasticSampler(range(50), shuffle=True, seed=11)
    s.set_world(0, 1)
    s.set_epoch(2)
    assert list(s) == np.random.default_rng(13).permutation(50).tolist()
    other = ElasticSampler(range(50), shuffle=True, seed=11)
    other.set_world(0, 1)
    other.set_epoch(3)
    assert list(other) != list(s), "a new epoch must bring a new order"
    plain = ElasticSampler(range(50), shuffle=False)
    plain.set_world(0, 1)
    assert list(plain) == list(range(50))
    assert all(type(i) is int for i in s), "indices must be Python ints, as Sampler[int] promises"


def test_padding_repeats_the_first_indices_and_counts_those_trained():
    s = ElasticSampler(range(10), shuffle=False)
    shards = []
    for rank in range(4):
        s.set_world(rank, 4)
        shards.append(list(s))
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert len(s) == 3 and s.num_dropped == 0
    s.record_batch(0, 2)  # positions 0..7: real indices
    assert s.padding_trained == 0
    s.record_batch(1, 2)  # positions 8..11: indices 8, 9 and the padding 0, 1
    assert s.padding_trained == 2
    assert s.num_processed == 10 and s.num_remaining == 0


def test_padding_cycles_when_fewer_indices_remain_than_ranks():
    s = ElasticSampler(range(1), shuffle=False)
    for rank in range(3):
        s.set_world(rank, 3)
        assert list(s) == [0]
    s.record_batch(0, 1)
    assert s.padding_trained == 2 and s.num_remaining == 0


def test_drop_last_cuts_the_tail_of_the_epoch_order_and_counts_it():
    s = ElasticSampler(range(10), shuffle=False, drop_last=True)
    shards = []
    for rank in range(4):
        s.set_world(rank, 4)
        shards.append(list(s))
    assert shards == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert len(s) == 2 and s.num_dropped == 2
    s.record_batch(0, 2)
    assert s.padding_trained == 0 and s.num_processed == 8
    assert list(s) == [] and s.num_dropped == 2 and s.num_remaining == 2
    s.set_world(0, 2)  # fewer ranks: the two left over now divide evenly
    assert list(s) == [8] and s.num_dropped == 0


def test_drop_last_with_fewer_indices_than_ranks_yields_nothing():
    s = ElasticSampler(range(3), drop_last=True)
    s.set_world(1, 4)
    assert len(s) == 0 and list(s) == [] and s.num_dropped == 3


def test_len_is_known_before_iterating_and_stays_the_iterations_length():
    for n, size, drop_last in [(10, 4, False), (10, 4, True), (7, 8, False), (0, 3, False), (64, 8, True)]:
        s = ElasticSampler(range(n), drop_last=drop_last)
        s.set_world(size - 1, size)
        expected = len(s)
        assert expected == len(list(s)), (n, size, drop_last)
        if expected:
            s.record_batch(0, 1)
            assert len(s) == expected, "len must not shrink within an iteration (a DataLoader's progress bar)"


def test_set_epoch_starts_afresh_but_the_same_epoch_keeps_progress():
    s = ElasticSampler(range(20), shuffle=False)
    s.set_world(0, 2)
    list(s)
    s.record_batch(0, 10)
    assert s.num_processed == 20 and s.padding_trained == 0
    s.set_epoch(0)  # the DistributedSampler habit at the top of the epoch loop, after a reset
    assert s.num_processed == 20
    s.set_epoch(1)
    assert s.epoch == 1 and s.num_processed == 0 and s.padding_trained == 0
    assert len(list(s)) == 10


def test_world_comes_from_the_worker_runtime_when_not_set(monkeypatch):
    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.runtime import process

    class Runtime:  # the worker's runtime, as ray_elastic.rank() and size() read it
        def joined(self) -> SimpleNamespace:
            return SimpleNamespace(slot=WorkerSlot("w1", "host", 1, 3, 0, 1, 0, 1))

    monkeypatch.setattr(process, "_current", Runtime())
    s = ElasticSampler(range(9), shuffle=False)
    assert len(s) == 3
    assert list(s) == [1, 4, 7]


def test_a_dataloader_over_a_half_done_epoch_loads_only_the_rest():
    dataset = list(range(100))
    s = ElasticSampler(dataset, seed=5)
    s.set_world(0, 1)
    loader = DataLoader(dataset, batch_size=8, sampler=s)
    seen = []
    for i, batch in enumerate(loader):
        seen += batch.tolist()
        s.record_batch(i, 8)
        if i == 5:
            break
    rest = [i for batch in DataLoader(dataset, batch_size=8, sampler=s) for i in batch.tolist()]
    assert len(seen) == 48 and sorted(seen + rest) == dataset


# ---- record_indices, union_ and the live bitmap --------------------------------------------


def test_record_indices_marks_only_this_rank_until_the_bitmaps_are_ored():
    a, b = ElasticSampler(range(30)), ElasticSampler(range(30))
    assert not a.needs_union
    a.record_indices([1, 2, 29])
    b.record_indices(np.array([5, 2]))
    assert a.needs_union and b.needs_union
    assert a.is_processed([1, 2, 5, 29]).tolist() == [True, True, False, True]
    a.union_(b.bitmap)
    b.union_(a.bitmap)
    for s in (a, b):
        assert s.num_processed == 4
        s.set_world(0, 1)
        assert not {1, 2, 5, 29} & set(s)
    a.needs_union = False  # what the handler does once every rank holds the OR
    assert not a.needs_union


def test_bitmap_is_live_so_an_in_place_allreduce_lands_in_the_sampler():
    a, b = ElasticSampler(range(100)), ElasticSampler(range(100))
    b.record_indices(range(0, 100, 3))
    live = a.bitmap
    assert live.flags.c_contiguous and live.flags.writeable and live.dtype == np.uint8
    assert live.nbytes == 13
    np.bitwise_or(live, b.bitmap, out=live)  # what a bitwise-OR allreduce does
    assert a.num_processed == 34 and a.is_processed([0, 3, 99]).all()


# ---- state_dict ------------------------------------------------------------------------


def test_state_dict_round_trip_reproduces_the_iteration_and_counters():
    s = ElasticSampler(range(50), shuffle=True, seed=4, drop_last=False)
    s.set_epoch(3)
    s.set_world(1, 4)
    list(s)
    s.record_batch(0, 5)
    s.record_batch(2, 5)  # the last batch: 2 of its positions are padding
    s.record_indices([7])
    sd = s.state_dict()
    fresh = ElasticSampler(range(50), shuffle=False, seed=0, drop_last=True)
    fresh.load_state_dict(sd)
    fresh.set_world(1, 4)
    s.set_world(1, 4)
    assert list(fresh) == list(s)
    for attr in ("epoch", "seed", "shuffle", "drop_last", "num_processed", "padding_trained", "needs_union"):
        assert getattr(fresh, attr) == getattr(s, attr), attr
    assert s.padding_trained == 2


def test_load_state_dict_rolls_back_in_the_same_buffer_and_ends_the_iteration():
    s = ElasticSampler(range(64), shuffle=False)
    s.set_world(0, 2)
    list(s)
    s.record_batch(0, 4)
    committed = s.state_dict()
    buffer = s.bitmap
    s.record_batch(1, 4)
    assert committed["bitmap"].sum() != s.bitmap.sum(), "state_dict must hold a copy, not the live bitmap"
    s.load_state_dict(committed)
    assert s.bitmap is buffer, "loading must not reallocate the bitmap"
    assert s.num_processed == 8
    with pytest.raises(RuntimeError, match="iterate"):
        s.record_batch(1, 4)
    assert list(s)[:2] == [8, 10]


def test_load_state_dict_rejects_another_dataset():
    s = ElasticSampler(range(64))
    with pytest.raises(ValueError, match="64"):
        s.load_state_dict(ElasticSampler(range(65)).state_dict())
    bad = s.state_dict()
    bad["bitmap"] = np.zeros(9, dtype=np.uint8)
    with pytest.raises(ValueError, match="shape"):
        s.load_state_dict(bad)


# ---- scale -------------------------------------------------------------------------------


def test_ten_million_samples_cost_about_a_megabyte():
    """Memory and correctness at scale; its speed is not a unit test's to time (a loaded machine failed a 5 s bound)."""
    n = 10_000_000
    s = ElasticSampler(range(n), shuffle=True, seed=1)
    assert s.bitmap.nbytes <= 1_300_000
    s.set_world(3, 8)
    s.set_epoch(1)
    first = next(iter(s))
    s.record_batch(0, 1000)
    shard = list(s)  # a second iteration, over what remains
    odd_done = int(np.count_nonzero(s.is_processed(np.arange(1, n, 2))))
    s.record_indices(np.arange(0, n, 2))
    assert len(shard) == 1_249_000 and first not in shard
    assert s.num_processed == 5_000_000 + odd_done
    assert s.state_dict()["bitmap"].nbytes <= 1_300_000


# ---- clear errors --------------------------------------------------------------------------


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="__len__"):
        ElasticSampler(iter(range(3)))
    with pytest.raises(ValueError, match="seed"):
        ElasticSampler(range(3), seed=-1)
    s = ElasticSampler(range(10))
    with pytest.raises(ValueError, match="rank"):
        s.set_world(2, 2)
    with pytest.raises(ValueError, match="size"):
        s.set_world(0, 0)
    with pytest.raises(RuntimeError, match="iterate"):
        s.record_batch(0, 2)
    s.set_world(0, 2)
    list(s)
    with pytest.raises(ValueError, match="batch_size"):
        s.record_batch(0, 0)
    with pytest.raises(ValueError, match="batch_idx"):
        s.record_batch(-1, 2)
    with pytest.raises(ValueError, match="starts past"):
        s.record_batch(3, 2)
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        s.record_indices([3, 10])
    with pytest.raises(IndexError):
        s.is_processed([-1])
    with pytest.raises(TypeError, match="integers"):
        s.record_indices([1.5])
    with pytest.raises(ValueError, match="epoch"):
        s.set_epoch(-2)
    with pytest.raises(ValueError, match="uint8"):
        s.union_(np.zeros(3, dtype=np.uint8))
    assert s.num_processed == 0 and not s.needs_union, "refused input must leave the sampler untouched"
