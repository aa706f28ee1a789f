"""The driver's core with the ranks' paces: a straggler let go gracefully, cooled down, offered again on probation.

Replayed from message scripts as `test_driver_core.py` does (no Ray,
milliseconds): the paces are what the ranks' meters would ship, the
verdicts the policy's (`test_stragglers_policy.py` holds its cases).
"""

from __future__ import annotations

from test_driver_core import Script

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.stragglers import WINDOW
from ray_elastic.protocol import EventKind, PaceSummary, Removed

HOSTS = {"A": 1, "B": 1, "C": 1, "D": 1}


def paces(s: Script, generation: int, slow: dict[str, float], members) -> list[m.PacesReported]:
    """A full window of summaries for every member; those in `slow` compute that many times as long."""
    out = []
    for w in members:
        compute = 0.03 * slow.get(w, 1.0)
        out.append(
            m.PacesReported(
                w, tuple(PaceSummary(generation, 0.0, 1.5, 40, 40 * compute, 40 * 0.005) for _ in range(WINDOW))
            )
        )
    return out


def test_a_straggler_leaves_gracefully_cools_down_and_is_offered_again_on_probation():
    s = Script(min_workers=2)
    s.start(HOSTS)
    s.send(*paces(s, 1, {"w4": 3.0}, ["w1", "w2", "w3", "w4"]))
    [publish] = s.of(m.Publish)
    assert set(publish.plan) == {"w1", "w2", "w3"} and "w4" in publish.notify  # told, so it leaves at its next check
    assert not s.of(m.Kill), "a graceful leave: no kill, no rollback"
    evicted = s.core.events[-1]
    assert (evicted.kind, evicted.generation, evicted.previous_world_size, evicted.world_size) == (
        EventKind.STRAGGLER_EVICTED,
        2,
        4,
        3,
    )
    for text in ("w4 on node D", "w4 computes 90.0 ms per step", "4 workers", "3 workers", "cooling down for 10 s"):
        assert text in evicted.detail
    assert [e.kind for e in s.core.events].count(EventKind.HOSTS_REMOVED) == 0
    s.send(m.WorkerExited("w4", Removed()))
    s.sync(publish)
    assert s.core.events[-1].reset_duration is not None
    s.send(m.HostsDiscovered(HOSTS), *paces(s, 2, {}, ["w1", "w2", "w3"]), after=5.0)
    assert s.of(m.Spawn) == [], "the host cools down"
    s.send(m.Tick(), *paces(s, 2, {}, ["w1", "w2", "w3"]), after=6.0)
    [again] = s.of(m.Spawn)
    assert again.host == "D"
    s.send(m.WorkerReady(again.worker_id))
    [gen3] = s.of(m.Publish)
    assert again.worker_id in gen3.plan and s.core.events[-1].kind is EventKind.HOSTS_ADDED
    s.sync(gen3)
    # slow again while on probation: the cool-down doubles
    s.send(*paces(s, 3, {again.worker_id: 3.0}, gen3.plan), after=15.0)
    assert "evicted again while on probation: cooling down for 20 s (doubled)" in s.core.events[-1].detail


def test_with_eviction_off_a_straggler_is_reported_once_and_kept():
    s = Script(min_workers=2, evict_stragglers=False)
    s.start(HOSTS)
    s.send(*paces(s, 1, {"w4": 3.0}, ["w1", "w2", "w3", "w4"]))
    assert s.of(m.Publish) == []
    found = s.core.events[-1]
    assert found.kind is EventKind.STRAGGLER_FOUND and "eviction is off" in found.detail and found.world_size == 4
    s.send(*paces(s, 1, {"w4": 3.0}, ["w1", "w2", "w3", "w4"]), after=2.0)
    assert [e.kind for e in s.core.events].count(EventKind.STRAGGLER_FOUND) == 1


def test_paces_of_a_generation_still_syncing_decide_nothing():
    s = Script(min_workers=2)
    s.start(HOSTS)
    s.send(m.WorkerDied("w1", "killed", node_alive=True))
    s.send(*paces(s, 1, {"w4": 3.0}, ["w2", "w3", "w4"]))
    assert s.of(m.Publish) == [] and s.core.events[-1].kind is EventKind.WORKER_FAILED


# ---- several workers per node: the decision is per worker --------------------------------------------------------
TWO_NODES = {"A": 4, "B": 4}  # w1-w4 on A, w5-w8 on B


def test_one_slow_worker_leaves_alone_and_its_slot_stays_empty_while_it_cools_down():
    s = Script(min_workers=2, max_workers=8)
    gen1 = s.start(TWO_NODES)
    s.send(*paces(s, 1, {"w3": 3.0}, gen1.plan))
    [publish] = s.of(m.Publish)
    assert set(publish.plan) == set(gen1.plan) - {"w3"}, "only the slow worker leaves, not its node"
    evicted = s.core.events[-1]
    assert evicted.kind is EventKind.STRAGGLER_EVICTED and (evicted.previous_world_size, evicted.world_size) == (8, 7)
    assert "w3 on node A" in evicted.detail and "8 workers" in evicted.detail and "7 workers" in evicted.detail
    assert "its slot on node A is cooling down for 10 s" in evicted.detail
    assert not any(w in evicted.detail.split(":")[1] for w in ("w1", "w2", "w4"))
    assert EventKind.HOSTS_REMOVED not in [e.kind for e in s.core.events], "nobody else is reported withdrawn"
    s.send(m.WorkerExited("w3", Removed()))
    s.sync(publish)
    s.send(m.HostsDiscovered(TWO_NODES), m.Tick(), after=5.0)
    assert s.of(m.Spawn) == [], "the slow worker's slot is not refilled at once"
    s.send(m.Tick(), after=6.0)
    [again] = s.of(m.Spawn)
    assert again.host == "A"


def test_with_min_workers_6_one_slow_slot_never_takes_the_run_below_it_nor_fails_it():
    s = Script(min_workers=6, max_workers=8, elastic_timeout=60.0)
    gen = s.start(TWO_NODES)
    slow_slot = "w3"
    sizes, evictions = [], 0
    for _ in range(40):  # 40 rounds over ~10 minutes: well past elastic_timeout
        s.send(*paces(s, gen.generation, {slow_slot: 3.0}, gen.plan), after=2.0)
        assert s.core.state.value != "waiting" and s.core.failure is None, s.core.failure
        publishes = s.of(m.Publish)
        if publishes:
            evictions += 1
            s.send(m.WorkerExited(slow_slot, Removed()))
            gen = publishes[-1]
            s.sync(gen)
        spawned = [a for a in s.of(m.Spawn)] + [a for a in s.send(m.Tick(), after=10.0) if isinstance(a, m.Spawn)]
        for newcomer in spawned:  # the slot offered again: its newcomer is as slow (the slot is what is slow)
            s.send(m.WorkerReady(newcomer.worker_id))
            [gen] = s.of(m.Publish)
            s.sync(gen)
            slow_slot = newcomer.worker_id
        sizes.append(len(gen.plan))
    assert min(sizes) >= 7 and s.core.failure is None
    assert evictions >= 2, "evicted, re-admitted after its cool-down, evicted again"
    doubled = [e for e in s.core.events if e.kind is EventKind.STRAGGLER_EVICTED][1]
    assert "doubled" in doubled.detail


def test_a_node_whose_every_worker_is_slow_leaves_whole_and_the_prediction_counts_all_of_them():
    slow_node = {w: 3.0 for w in ("w5", "w6", "w7", "w8")}
    s = Script(min_workers=4, max_workers=8)
    gen1 = s.start(TWO_NODES)
    s.send(*paces(s, 1, slow_node, gen1.plan))
    [publish] = s.of(m.Publish)
    assert set(publish.plan) == {"w1", "w2", "w3", "w4"}
    evicted = s.core.events[-1]
    assert evicted.kind is EventKind.STRAGGLER_EVICTED
    assert "w5, w6, w7, w8 on node B (every worker of the node)" in evicted.detail
    assert "4 workers" in evicted.detail and "8/4 x" in evicted.detail and "the node is cooling down" in evicted.detail
    assert EventKind.HOSTS_REMOVED not in [e.kind for e in s.core.events], "co-evicted workers are not 'withdrawn'"
    s.send(*[m.WorkerExited(w, Removed()) for w in slow_node])
    s.sync(publish)
    s.send(m.HostsDiscovered(TWO_NODES), m.Tick(), after=5.0)
    assert s.of(m.Spawn) == [], "the whole node cools down"


def test_a_slow_node_that_would_take_the_run_below_min_workers_is_kept_and_reported_once():
    slow_node = {w: 3.0 for w in ("w5", "w6", "w7", "w8")}
    s = Script(min_workers=6, max_workers=8, elastic_timeout=60.0)
    gen1 = s.start(TWO_NODES)
    for _ in range(40):
        s.send(*paces(s, 1, slow_node, gen1.plan), after=2.0)
        s.send(m.Tick())
        assert s.of(m.Publish) == [] and s.core.state.value == "running"
    found = [e for e in s.core.events if e.kind is EventKind.STRAGGLER_FOUND]
    assert len(found) == 1 and "4 workers would be fewer than min_workers=6" in found[0].detail
    assert s.core.failure is None and len(s.core.plan) == 8


# ---- at thousands of ranks ---------------------------------------------------------------------------------------
def big_run(workers: int) -> tuple[Script, m.Publish]:
    s = Script(min_workers=1, max_workers=workers)
    return s, s.start({f"h{i:04d}": 8 for i in range(workers // 8)})


def test_the_pace_windows_stay_out_of_the_snapshot_and_a_restarted_driver_refills_them():
    import pickle

    s, gen = big_run(512)
    empty = len(pickle.dumps(s.core))
    s.send(*paces(s, 1, {}, gen.plan))
    full = len(pickle.dumps(s.core))
    assert full < empty + 4096, f"{empty} bytes with empty windows, {full} with full ones"
    s.core = pickle.loads(pickle.dumps(s.core))  # a restarted driver's core
    s.send(*paces(s, 1, {"w7": 3.0}, gen.plan), after=2.0)
    [publish] = s.of(m.Publish)
    assert "w7" not in publish.plan and len(publish.plan) == 511


def test_a_pace_message_looks_at_its_own_worker_only_while_the_windows_fill(monkeypatch):
    from ray_elastic.driver.core.roster import Roster

    s, gen = big_run(1024)
    looked = []
    real = Roster.__getitem__
    monkeypatch.setattr(Roster, "__getitem__", lambda self, w: looked.append(w) or real(self, w))
    members = list(gen.plan)
    for i, w in enumerate(members[:200]):  # the windows fill: no member's is full yet
        s.send(m.PacesReported(w, (PaceSummary(1, 0.0, 1.5, 40, 1.2, 0.2),)), after=0.01 + 2.0 * (i % 2))
    assert len(looked) <= 200, f"{len(looked)} roster lookups for 200 pace messages of a 1024-worker ring"
