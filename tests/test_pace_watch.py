"""The driver's core with the ranks' paces: a straggler let go gracefully, cooled down, offered again on probation.

Replayed from message scripts as `test_driver_core.py` does (no Ray,
milliseconds): the paces are what the ranks' meters would ship, the
verdicts the policy's (`test_stragglers_policy.py` holds its cases).
"""

from __future__ import annotations

from test_driver_core import Script

from ray_elastic.driver import messages as m
from ray_elastic.driver.stragglers import WINDOW
from ray_elastic.protocol import EventKind, Removed
from ray_elastic.runtime.pace import PaceSummary

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
