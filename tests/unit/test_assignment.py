"""Unit tests for `ray_elastic.assignment`: rank assignment, scaling plans, cool-down.

Pure functions and a pure class: no Ray, every test runs in milliseconds.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_elastic.assignment import Cooldown, LiveWorker, ScalePlan, WorkerSlot, assign_ranks, plan_scaling

HOST_NAMES = [f"h{i}" for i in range(6)]


@st.composite
def live_workers(draw: st.DrawFn, max_size: int = 12) -> list[LiveWorker]:
    """Workers on a few hosts with distinct spawn orders, in arbitrary list order."""
    hosts = draw(st.lists(st.sampled_from(HOST_NAMES), max_size=max_size))
    seqs = draw(st.lists(st.integers(0, 1000), min_size=len(hosts), max_size=len(hosts), unique=True))
    workers = [LiveWorker(worker_id=f"w{seq}", host=host, seq=seq) for host, seq in zip(hosts, seqs, strict=True)]
    return draw(st.permutations(workers))


def by_host(workers: list[LiveWorker]) -> dict[str, list[LiveWorker]]:
    out: dict[str, list[LiveWorker]] = {}
    for w in sorted(workers, key=lambda w: w.seq):
        out.setdefault(w.host, []).append(w)
    return out


# ---- assign_ranks ----------------------------------------------------------------


def test_assign_ranks_orders_hosts_by_their_oldest_worker():
    workers = [
        LiveWorker("w5", "hostA", 5),
        LiveWorker("w1", "hostB", 1),
        LiveWorker("w3", "hostA", 3),
        LiveWorker("w7", "hostB", 7),
    ]
    slots = assign_ranks(workers)
    # hostB holds the oldest worker (seq 1), so it comes first and w1 is rank 0
    assert slots == {
        "w1": WorkerSlot("w1", "hostB", rank=0, size=4, local_rank=0, local_size=2, cross_rank=0, cross_size=2),
        "w7": WorkerSlot("w7", "hostB", rank=1, size=4, local_rank=1, local_size=2, cross_rank=0, cross_size=2),
        "w3": WorkerSlot("w3", "hostA", rank=2, size=4, local_rank=0, local_size=2, cross_rank=1, cross_size=2),
        "w5": WorkerSlot("w5", "hostA", rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2),
    }


def test_assign_ranks_uneven_hosts_cross_size_counts_hosts_with_that_local_rank():
    workers = [LiveWorker(f"a{i}", "A", i) for i in range(3)] + [LiveWorker("b0", "B", 10)]
    slots = assign_ranks(workers)
    assert [(slots[w].local_rank, slots[w].cross_rank, slots[w].cross_size) for w in ("a0", "a1", "a2", "b0")] == [
        (0, 0, 2),
        (1, 0, 1),
        (2, 0, 1),
        (0, 1, 2),
    ]
    assert slots["b0"].rank == 3 and slots["b0"].local_size == 1
    assert all(s.local_size == 3 for k, s in slots.items() if k.startswith("a"))


def test_assign_ranks_survivor_of_a_failure_becomes_rank_0():
    before = assign_ranks([LiveWorker("w0", "A", 0), LiveWorker("w1", "B", 1), LiveWorker("w2", "A", 2)])
    assert before["w0"].rank == 0
    # w0 dies: the oldest survivor (w1, which holds the freshest committed state) must be rank 0
    after = assign_ranks([LiveWorker("w1", "B", 1), LiveWorker("w2", "A", 2), LiveWorker("w9", "C", 9)])
    assert after["w1"].rank == 0
    assert {s.size for s in after.values()} == {3}


@given(live_workers(), st.data())
def test_assign_ranks_puts_a_holder_of_the_trained_state_at_rank_0_before_any_older_newcomer(workers, data):
    """A never-synced newcomer as rank 0 would overwrite every rank's trained state with its own."""
    holding = data.draw(st.sets(st.sampled_from([w.worker_id for w in workers])) if workers else st.just(set()))
    workers = [w._replace(holds=w.worker_id in holding) for w in workers]
    slots = assign_ranks(workers)
    by_rank = sorted(slots.values(), key=lambda s: s.rank)
    if holding:
        oldest_holder = min((w for w in workers if w.holds), key=lambda w: w.seq)
        assert by_rank[0].worker_id == oldest_holder.worker_id
    for host in {w.host for w in workers}:  # on each host: holders, then newcomers, each oldest first
        on_host = [w for w in workers if w.host == host]
        expected = sorted(on_host, key=lambda w: (not w.holds, w.seq))
        assert [s.worker_id for s in by_rank if s.host == host] == [w.worker_id for w in expected]


def test_assign_ranks_of_no_workers_is_empty():
    assert assign_ranks([]) == {}


@given(live_workers())
def test_assign_ranks_is_a_horovod_consistent_layout(workers: list[LiveWorker]):
    slots = assign_ranks(workers)
    n = len(workers)
    assert set(slots) == {w.worker_id for w in workers}
    assert sorted(s.rank for s in slots.values()) == list(range(n))
    assert all(s.size == n for s in slots.values())
    if n:
        oldest = min(workers, key=lambda w: w.seq)
        assert slots[oldest.worker_id].rank == 0

    groups = by_host(workers)
    # hosts in the order of their oldest worker, each a contiguous block of ranks
    host_order = sorted(groups, key=lambda h: groups[h][0].seq)
    next_rank = 0
    for host in host_order:
        members = groups[host]
        for local_rank, w in enumerate(members):  # oldest first within the host
            s = slots[w.worker_id]
            assert s.host == host
            assert s.rank == next_rank + local_rank
            assert s.local_rank == local_rank
            assert s.local_size == len(members)
            # Horovod: cross ranks index the hosts that have a worker at this local rank
            hosts_with_local_rank = [h for h in host_order if len(groups[h]) > local_rank]
            assert s.cross_size == len(hosts_with_local_rank)
            assert s.cross_rank == hosts_with_local_rank.index(host)
        next_rank += len(members)


@given(live_workers(), st.randoms(use_true_random=False))
def test_assign_ranks_does_not_depend_on_input_order(workers: list[LiveWorker], rnd):
    shuffled = list(workers)
    rnd.shuffle(shuffled)
    assert assign_ranks(shuffled) == assign_ranks(workers)


# ---- plan_scaling ----------------------------------------------------------------


def test_plan_scaling_is_noop_when_world_matches_discovery():
    workers = [LiveWorker("w0", "A", 0), LiveWorker("w1", "B", 1)]
    plan = plan_scaling(workers, {"A": 1, "B": 1}, {"A": 0.0, "B": 1.0}, cooling=(), max_workers=4)
    assert plan.is_noop
    assert plan.remove == () and not any(plan.add.values())


def test_plan_scaling_removes_workers_of_a_vanished_host_and_replaces_them_elsewhere():
    workers = [LiveWorker("w0", "A", 0), LiveWorker("w1", "B", 1), LiveWorker("w2", "B", 2)]
    plan = plan_scaling(workers, {"A": 3}, {"A": 0.0, "B": 1.0}, cooling=(), max_workers=3)
    assert set(plan.remove) == {"w1", "w2"}
    assert dict(plan.add) == {"A": 2}
    assert not plan.is_noop


def test_plan_scaling_shrinking_host_loses_its_youngest_workers():
    workers = [LiveWorker("w2", "A", 2), LiveWorker("w0", "A", 0), LiveWorker("w5", "A", 5), LiveWorker("w1", "B", 1)]
    plan = plan_scaling(workers, {"A": 1, "B": 1}, {"A": 0.0, "B": 1.0}, cooling=(), max_workers=8)
    assert set(plan.remove) == {"w2", "w5"}
    assert not any(plan.add.values())


def test_plan_scaling_over_max_workers_removes_the_youngest_overall():
    workers = [LiveWorker(f"w{i}", "AB"[i % 2], i) for i in range(6)]
    plan = plan_scaling(workers, {"A": 3, "B": 3}, {"A": 0.0, "B": 1.0}, cooling=(), max_workers=4)
    assert set(plan.remove) == {"w4", "w5"}
    assert not any(plan.add.values())


def test_plan_scaling_fills_the_oldest_host_first():
    plan = plan_scaling([], {"new": 4, "old": 4}, {"old": 1.0, "new": 2.0}, cooling=(), max_workers=5)
    assert dict(plan.add) == {"old": 4, "new": 1}


def test_plan_scaling_never_adds_on_cooling_hosts_but_keeps_workers_there():
    workers = [LiveWorker("w0", "A", 0)]
    plan = plan_scaling(workers, {"A": 4, "B": 2}, {"A": 0.0, "B": 1.0}, cooling={"A"}, max_workers=8)
    assert plan.remove == ()
    assert dict(plan.add) == {"B": 2}


def test_plan_scaling_adds_nothing_when_only_cooling_hosts_have_room():
    plan = plan_scaling([], {"A": 4}, {"A": 0.0}, cooling={"A"}, max_workers=4)
    assert plan.is_noop


def test_scale_plan_with_zero_additions_is_noop():
    assert ScalePlan(add={"A": 0}).is_noop
    assert not ScalePlan(add={"A": 1}).is_noop
    assert not ScalePlan(remove=("w0",)).is_noop


@st.composite
def scaling_inputs(draw: st.DrawFn):
    workers = draw(live_workers())
    offered = draw(st.dictionaries(st.sampled_from(HOST_NAMES), st.integers(0, 4)))
    first_seen = {h: draw(st.floats(0, 100, allow_nan=False)) for h in HOST_NAMES if draw(st.booleans())}
    cooling = draw(st.sets(st.sampled_from(HOST_NAMES)))
    max_workers = draw(st.integers(1, 12))
    return workers, offered, first_seen, cooling, max_workers


@given(scaling_inputs())
def test_plan_scaling_properties(inputs):
    workers, offered, first_seen, cooling, max_workers = inputs
    plan = plan_scaling(workers, offered, first_seen, cooling, max_workers)

    ids = {w.worker_id for w in workers}
    removed = set(plan.remove)
    assert len(removed) == len(plan.remove), "a worker is removed twice"
    assert removed <= ids
    kept = [w for w in workers if w.worker_id not in removed]
    after: dict[str, int] = {}
    for w in kept:
        after[w.host] = after.get(w.host, 0) + 1
    for host, n in plan.add.items():
        assert n > 0
        assert host not in cooling, "newcomers placed on a cooling host"
        assert host in offered
        after[host] = after.get(host, 0) + n

    # never beyond max_workers, never beyond what a host offers
    assert sum(after.values()) <= max_workers
    for host, n in after.items():
        assert n <= offered.get(host, 0)

    # a host that still offers its slots keeps all its workers, unless max_workers forces a cut
    fits = all(len(ws) <= offered.get(h, 0) for h, ws in by_host(workers).items())
    if fits and len(workers) <= max_workers:
        assert plan.remove == ()
    if fits and len(workers) > max_workers:
        assert len(removed) == len(workers) - max_workers
        assert all(r.seq > k.seq for r in workers if r.worker_id in removed for k in kept)

    # on each host, the survivors are its oldest workers
    for members in by_host(workers).values():
        flags = [w.worker_id in removed for w in members]
        assert flags == sorted(flags), "an older worker was removed while a younger one on its host stayed"

    # oldest host first: a host gets newcomers only once every older eligible host is full
    order = sorted(offered, key=lambda h: (first_seen.get(h, float("inf")), h))
    eligible = [h for h in order if h not in cooling]
    for i, host in enumerate(eligible):
        if plan.add.get(host, 0):
            for older in eligible[:i]:
                assert after.get(older, 0) == offered[older], f"{host} filled before older host {older}"

    # no idle room: if an eligible host still has a free slot, the world is at max_workers
    if any(after.get(h, 0) < offered[h] for h in eligible):
        assert sum(after.values()) == max_workers


# ---- Cooldown --------------------------------------------------------------------


@pytest.mark.parametrize("bad", [(-1, 10), (10, 5)])
def test_cooldown_rejects_invalid_ranges(bad):
    with pytest.raises(ValueError, match="cooldown_range"):
        Cooldown(*bad)


def test_cooldown_first_failure_keeps_host_out_for_min_then_offers_it_again():
    cd = Cooldown(10, 300)
    assert cd.record_failure("A", now=100.0) == 10
    assert cd.is_cooling("A", 100.0)
    assert cd.is_cooling("A", 109.9)
    assert cd.cooling(105.0) == {"A"}
    assert not cd.is_cooling("A", 110.0)
    assert cd.cooling(110.0) == set()
    assert not cd.is_cooling("B", 100.0)


def test_cooldown_back_off_doubles_and_is_capped():
    cd = Cooldown(10, 300)
    lengths = [cd.record_failure("A", now=float(i)) for i in range(8)]
    assert lengths == [10, 20, 40, 80, 160, 300, 300, 300]


def test_cooldown_host_failing_each_time_it_is_offered_stays_at_the_cap():
    # A permanently broken host: each time its cool-down ends it gets a worker, which fails 1 s later.
    # Its back-off must keep growing up to max_s and stay there, not fall back to min_s.
    cd = Cooldown(10, 300)
    now = 0.0
    lengths = []
    for _ in range(8):
        length = cd.record_failure("A", now)
        lengths.append(length)
        now += length + 1.0
    assert lengths == [10, 20, 40, 80, 160, 300, 300, 300]


def test_cooldown_counts_are_per_host():
    cd = Cooldown(10, 300)
    cd.record_failure("A", 0.0)
    cd.record_failure("A", 1.0)
    assert cd.record_failure("B", 2.0) == 10
    assert cd.cooling(5.0) == {"A", "B"}
    assert cd.cooling(12.0) == {"A"}  # A: 1 + 20 = 21; B: 2 + 10 = 12


def test_cooldown_failure_count_is_forgotten_after_a_quiet_period():
    cd = Cooldown(1, 100, forget_after=5)
    assert cd.record_failure("A", 0.0) == 1
    assert cd.record_failure("A", 2.0) == 2  # within forget_after: doubles
    assert cd.record_failure("A", 10.0) == 1  # quiet for longer than forget_after: back to min
    assert cd.record_failure("A", 11.0) == 2


def test_cooldown_failure_within_forget_after_is_not_forgotten():
    cd = Cooldown(1, 100, forget_after=5)
    cd.record_failure("A", 0.0)
    assert cd.record_failure("A", 5.0) == 2


def test_cooldown_forget_after_defaults_to_max():
    cd = Cooldown(10, 300)
    cd.record_failure("A", 0.0)
    assert cd.record_failure("A", 250.0) == 20
    assert cd.record_failure("A", 1000.0) == 10


def test_cooldown_failure_while_cooling_extends_and_never_shortens():
    cd = Cooldown(10, 300)
    cd.record_failure("A", 0.0)  # until 10
    cd.record_failure("A", 1.0)  # 20 s: until 21
    assert cd.is_cooling("A", 20.9)
    assert not cd.is_cooling("A", 21.0)
    assert cd.next_release(0.0) == 21.0


def test_cooldown_next_release_is_the_earliest_pending_release():
    cd = Cooldown(10, 300)
    assert cd.next_release(0.0) is None
    cd.record_failure("A", 0.0)  # until 10
    cd.record_failure("B", 5.0)  # until 15
    assert cd.next_release(1.0) == 10.0
    assert cd.next_release(10.0) == 15.0  # A is released at 10
    assert cd.next_release(15.0) is None


def test_cooldown_zero_range_never_holds_a_host_back():
    cd = Cooldown(0, 0)
    assert cd.record_failure("A", 0.0) == 0
    assert not cd.is_cooling("A", 0.0)
    assert cd.next_release(0.0) is None


@given(
    st.floats(0.1, 50, allow_nan=False),
    st.floats(1, 20, allow_nan=False),
    st.lists(st.floats(0, 0.99, allow_nan=False), min_size=1, max_size=15),
)
def test_cooldown_lengths_follow_the_exponential_formula(min_s: float, factor: float, gap_fractions: list[float]):
    max_s = min_s * factor
    cd = Cooldown(min_s, max_s)
    now = 0.0
    for n, frac in enumerate(gap_fractions, start=1):
        length = cd.record_failure("h", now)
        assert length == min(max_s, min_s * 2 ** (n - 1))
        assert cd.is_cooling("h", now) == (length > 0)
        assert not cd.is_cooling("h", now + length)  # ban for this failure alone ends here
        now += frac * cd.forget_after  # next failure within forget_after: not forgotten
