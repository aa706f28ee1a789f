"""The sync's plan without a cluster: who holds rank 0's commit, and how the bytes are cut and spread."""

from __future__ import annotations

import pytest

from ray_elastic.runtime.commits import CommitId, fresh_commit_id, judge_adoption
from ray_elastic.state.sync_plan import order_transfers, plan_sync, schedule_chunks


def test_equal_commits_have_equal_fingerprints_and_the_next_commit_differs():
    a = CommitId("lineage", 4)
    assert a.fingerprint() == CommitId("lineage", 4).fingerprint()
    assert a.next().fingerprint() != a.fingerprint()
    assert fresh_commit_id().fingerprint() != fresh_commit_id().fingerprint()
    assert 0 < a.fingerprint() < 2**63


def test_survivors_holding_rank0s_commit_receive_nothing():
    plan = plan_sync([7, 7, 7], rank=1)
    assert plan.holders == (0, 1, 2) and plan.receivers == ()
    assert not plan.moves_state and not plan.receives


def test_newcomers_and_a_rank_one_commit_ahead_receive_rank0s_commit():
    plan = plan_sync([7, 8, 7, 3], rank=3)
    assert plan.holders == (0, 2)
    assert plan.receivers == (1, 3)
    assert plan.receives


def covered(chunks, sizes) -> bool:
    """Every byte of every buffer in exactly one piece, in order."""
    seen: dict[int, list[tuple[int, int]]] = {i: [] for i, n in enumerate(sizes) if n}
    for chunk in chunks:
        for p in chunk.pieces:
            seen[p.buffer].append((p.start, p.stop))
    for i, ranges in seen.items():
        pos = 0
        for a, b in ranges:
            if a != pos:
                return False
            pos = b
        if pos != sizes[i]:
            return False
    return True


@pytest.mark.parametrize("sizes", [[100], [3, 5, 1000, 2, 2, 64], [0, 10, 0], [64] * 20])
def test_chunks_cover_every_byte_once_and_stay_within_the_bound(sizes):
    chunks = schedule_chunks(sizes, senders=[0, 2], chunk_bytes=64)
    assert covered(chunks, sizes)
    assert all(0 < c.nbytes <= 64 for c in chunks)
    assert sum(c.nbytes for c in chunks) == sum(sizes)


def test_small_tensors_are_packed_ahead_and_a_large_one_travels_alone_in_slices():
    chunks = schedule_chunks([10, 10, 10, 200, 3, 40, 20], senders=[0], chunk_bytes=64, direct_bytes=32)
    assert [[p.buffer for p in c.pieces] for c in chunks] == [[0, 1, 2, 4, 6], [3], [3], [3], [3], [5]]
    assert [c.nbytes for c in chunks] == [53, 64, 64, 64, 8, 40]


def test_small_tensors_between_large_ones_cost_one_message_not_one_each():
    # a model's layers: a 4 MB weight and a 4 KB bias each, then Adam's moments and step counts
    sizes = [4 * 2**20, 4 * 2**10] * 10 + [4 * 2**20, 4 * 2**20, 4] * 10
    chunks = schedule_chunks(sizes, senders=[0, 1], chunk_bytes=16 * 2**20)
    assert len(chunks) == 30 + 1
    assert covered(chunks, sizes)


def test_a_chunk_never_mixes_devices_and_ranks_whose_device_indices_differ_cut_the_same_chunks():
    # a GPU model's biases beside AdamW's step counts and a sampler's bitmap, which torch keeps on the host
    sizes = [20, 4, 20, 4, 4000, 8, 20, 4]
    here = ["cuda:0", "cpu", "cuda:0", "cpu", "cuda:0", "cpu", "cuda:0", "cpu"]
    chunks = schedule_chunks(sizes, senders=[0, 1], chunk_bytes=64, direct_bytes=48, groups=here)
    assert covered(chunks, sizes) and all(c.nbytes <= 64 for c in chunks)
    assert all(len({here[p.buffer] for p in c.pieces}) == 1 for c in chunks), "a chunk spans two devices"
    packed = [[p.buffer for p in c.pieces] for c in chunks if len(c.pieces) > 1]
    assert packed == [[0, 2, 6], [1, 3, 5, 7]], "each device's small buffers packed, the device's order kept"
    there = [d.replace("cuda:0", "cuda:1") for d in here]
    assert schedule_chunks(sizes, senders=[0, 1], chunk_bytes=64, direct_bytes=48, groups=there) == chunks
    assert schedule_chunks(sizes, [0], 64, groups=None) == schedule_chunks(sizes, [0], 64, groups=["cpu"] * 8)
    with pytest.raises(ValueError, match="group keys"):
        schedule_chunks(sizes, [0], 64, groups=["cpu"])


def test_holders_share_the_sending_in_contiguous_runs():
    chunks = schedule_chunks([1000], senders=[0, 1, 3], chunk_bytes=10)
    senders = [c.sender for c in chunks]
    assert senders == sorted(senders, key=[0, 1, 3].index)  # each sender's run is contiguous
    counts = [senders.count(s) for s in (0, 1, 3)]
    assert max(counts) - min(counts) <= 1


def test_transfers_interleave_senders_and_reach_every_receiver():
    chunks = schedule_chunks([40], senders=[0, 1], chunk_bytes=10)
    order = order_transfers(chunks, receivers=[2, 3])
    assert len(order) == len(chunks) * 2
    assert [s for _, s, _ in order[:4]] == [0, 0, 1, 1]  # first chunk of each sender early
    assert {(i, r) for i, _, r in order} == {(i, r) for i in range(len(chunks)) for r in (2, 3)}


class RecordingRing:
    """A receiving rank's ring that only counts: the bytes posted and not yet waited for (no transport)."""

    point_to_point = True

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.outstanding = 0
        self.most = 0

    def recv_async(self, value, src):
        from ray_elastic.collective.base import CollectiveWork

        nbytes = value.numel() * value.element_size()
        self.outstanding += nbytes
        self.most = max(self.most, self.outstanding)

        def done() -> None:
            self.outstanding -= nbytes

        return CollectiveWork("receive", done)

    send_async = recv_async


@pytest.mark.parametrize("tensor_mb", [1, 4, 16])
def test_a_transfer_keeps_at_most_window_times_chunk_bytes_in_flight_whatever_the_tensors_sizes(tensor_mb):
    """The bound is in bytes: 1 MB tensors get 16 chunks in flight, not 4 (the ranks waited on wake-ups)."""
    import torch

    from ray_elastic.state.sync_plan import SyncPlan
    from ray_elastic.torch import broadcast

    tensors = [torch.zeros(tensor_mb * 2**18) for _ in range(24)]  # float32: tensor_mb MB each
    ring = RecordingRing(rank=2)
    plan = SyncPlan(2, holders=(0, 1), receivers=(2,))
    received = broadcast.send_tensors_(ring, plan, tensors, chunk_bytes=4 * 2**20, window=4)
    assert received == 24 * tensor_mb * 2**20 and ring.outstanding == 0
    assert ring.most <= 4 * 4 * 2**20, "more than window * chunk_bytes in flight"
    assert ring.most == 4 * 4 * 2**20, "the window is filled: as many chunks in flight as fit in it"


def test_a_rank_never_adopts_an_older_commit_from_another_history():
    """A rank 0 from another history (a never-synced newcomer, an old checkpoint) must not undo training."""
    assert judge_adoption("mine", 120, "fresh", 0) == (
        "rank 0 holds commit 0, older than commit 120 held here; adopting it would undo 120 commit(s) of training"
    )
    assert judge_adoption("mine", 120, "checkpoint", 100) is not None
    assert judge_adoption("mine", 0, "fresh", 0) is None, "a newcomer that holds nothing takes anything"
    assert judge_adoption("mine", 100, "checkpoint", 100) is None
    assert judge_adoption("mine", 100, "theirs", 130) is None, "a newer commit from rank 0 is what a sync is for"
    # one history: a step torn by a failure (this rank saved, rank 0 did not) rolls back to the commit all reached
    assert judge_adoption("shared", 41, "shared", 40) is None
