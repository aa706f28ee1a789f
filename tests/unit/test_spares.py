"""Hot spares (`spares=K`) in the pure core: booted ahead of need, promoted into a place, never in a ring before.

Each test replays what the shell would send (no Ray) and asserts what a user
would see: who forms each generation, where spares start, which are let go,
and the events that say so.
"""

from __future__ import annotations

from test_driver_core import Script

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.driver_core import WorkerStatus
from ray_elastic.protocol import DriverState, EventKind, Finished

HOSTS = {"A": 2, "B": 2, "C": 2}  # 6 slots: 4 members (max_workers) and room for spares


def spawns(s: Script, spare: bool) -> list[m.Spawn]:
    return [a for a in s.of(m.Spawn) if a.spare is spare]


def running_with_a_ready_spare(spares: int = 1) -> tuple[Script, m.Publish, list[str]]:
    """4 members on A and B (the oldest hosts), the spare(s) booted on C; generation 1 formed without them."""
    s = Script(min_workers=2, max_workers=4, spares=spares)
    s.send(m.HostsDiscovered(HOSTS))
    members, standby = spawns(s, False), spawns(s, True)
    assert [a.host for a in members] == ["A", "A", "B", "B"]
    assert [a.host for a in standby] == ["C"] * spares, "a spare goes where no member runs"
    s.send(*[m.WorkerReady(a.worker_id) for a in members])
    [publish] = s.of(m.Publish)  # the spares' boot held nothing back
    assert sorted(publish.plan) == sorted(a.worker_id for a in members)
    s.sync(publish)
    s.send(*[m.WorkerReady(a.worker_id) for a in standby])
    assert s.of(m.Publish) == [], "a ready spare joins no ring while no place is open"
    return s, publish, [a.worker_id for a in standby]


def test_a_members_death_promotes_the_ready_spare_in_the_same_batch_and_a_new_spare_starts():
    s, gen1, [spare] = running_with_a_ready_spare()
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert sorted(gen2.plan) == sorted([*(w for w in gen1.plan if w != "w1"), spare]), "back to 4 at once"
    assert spawns(s, False) == [], "no newcomer boots: the spare took the place"
    [replacement] = spawns(s, True)
    assert replacement.host == "C", "A cools down after the failure; C has the free slot"
    [promoted] = [e for e in s.core.events if e.kind is EventKind.SPARE_PROMOTED]
    assert spare in promoted.detail and promoted.generation == 2
    s.sync(gen2)
    assert s.core.state is DriverState.RUNNING and promoted.reset_duration is not None


def test_two_spares_fill_two_places_and_a_third_death_falls_back_to_a_newcomer():
    s, gen1, standby = running_with_a_ready_spare(spares=2)
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True), m.WorkerDied("w3", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert set(standby) <= set(gen2.plan) and len(gen2.plan) == 4
    assert spawns(s, False) == [] and spawns(s, True) == [], "A and B cool down, C is full: nowhere to start"
    s.sync(gen2)
    s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True))
    [gen3] = s.of(m.Publish)
    assert len(gen3.plan) == 3, "no spare left: the world shrinks, as without spares"


def test_a_spare_still_booting_becomes_a_newcomer_and_the_survivors_go_on_without_waiting_for_it():
    s = Script(min_workers=2, max_workers=4, spares=1)
    s.send(m.HostsDiscovered(HOSTS))
    members, [spare] = spawns(s, False), spawns(s, True)
    s.send(*[m.WorkerReady(a.worker_id) for a in members])
    [gen1] = s.of(m.Publish)
    s.sync(gen1)
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert len(gen2.plan) == 3 and spare.worker_id not in gen2.plan, "a death publishes at once"
    assert s.core.workers[spare.worker_id].status is WorkerStatus.STARTING
    s.sync(gen2)
    s.send(m.WorkerReady(spare.worker_id))
    [gen3] = s.of(m.Publish)
    assert spare.worker_id in gen3.plan and len(gen3.plan) == 4


def test_a_spare_that_dies_or_hangs_is_replaced_and_never_joins():
    s, gen1, [spare] = running_with_a_ready_spare()
    s.send(m.WorkerDied(spare, "SIGKILL", node_alive=False))  # its node went with it
    assert s.of(m.Publish) == [], "nobody trained with it: no reset"
    [failed] = [e for e in s.core.events if e.kind is EventKind.NEWCOMER_FAILED]
    assert failed.detail.startswith(f"hot spare worker {spare} ")
    s.send(m.HostsDiscovered({"A": 2, "B": 2, "D": 2}))
    [replacement] = spawns(s, True)
    assert replacement.host == "D"
    s.send(m.WorkerReady(replacement.worker_id))
    stopped = {replacement.worker_id: m.CpuSample(0.0, 0.5, "T")}
    s.send(m.PingResults(frozenset(), frozenset({replacement.worker_id}), s.now, stopped), after=1.0)
    assert m.Kill(replacement.worker_id, failed=True) in s.actions, "a hung spare is killed"
    s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert replacement.worker_id not in gen2.plan and spare not in gen2.plan
    assert all(s.core.workers[w].status is WorkerStatus.MEMBER for w in gen2.plan)


def test_with_no_room_beyond_max_workers_there_is_no_spare_members_come_first():
    s = Script(min_workers=2, max_workers=4, spares=1)
    s.send(m.HostsDiscovered({"A": 2, "B": 2}))
    assert len(spawns(s, False)) == 4 and spawns(s, True) == []
    s.send(m.HostsDiscovered({"A": 2, "B": 2, "C": 1}))
    assert [a.host for a in spawns(s, True)] == ["C"], "a slot beyond max_workers: a spare"


def test_a_host_added_under_max_workers_promotes_the_spare_and_the_new_slot_gets_a_new_spare():
    s = Script(min_workers=2, max_workers=5, spares=1)
    s.send(m.HostsDiscovered({"A": 2, "B": 2}))
    members = spawns(s, False)
    assert len(members) == 4 and spawns(s, True) == [], "members first: 4 of max_workers=5, no room for a spare"
    s.send(*[m.WorkerReady(a.worker_id) for a in members])
    [gen1] = s.of(m.Publish)
    s.sync(gen1)
    s.send(m.HostsDiscovered({"A": 2, "B": 2, "C": 2}))
    assert len(spawns(s, False)) == 1 and [a.host for a in spawns(s, True)] == ["C"]
    [newcomer] = spawns(s, False)
    [spare] = spawns(s, True)
    s.send(m.WorkerReady(spare.worker_id))
    assert s.of(m.Publish) == [], "the spare waits; the newcomer boots for the fifth place"
    s.send(m.WorkerReady(newcomer.worker_id))
    [gen2] = s.of(m.Publish)
    assert newcomer.worker_id in gen2.plan and spare.worker_id not in gen2.plan


def test_a_spare_on_a_draining_node_is_let_go_and_started_again_elsewhere():
    s, gen1, [spare] = running_with_a_ready_spare()
    s.send(m.HostsDiscovered({**HOSTS, "D": 1}))
    s.send(m.NodesDraining({"C": 0.0}))
    assert m.Kill(spare) in s.actions and spare not in s.core.alive_ids()
    assert [a.host for a in spawns(s, True)] == ["D"]
    assert s.of(m.Publish) == [], "a spare leaving changes no ring"


def test_the_run_finishing_lets_the_spares_go():
    s, gen1, [spare] = running_with_a_ready_spare()
    s.send(*[m.WorkerExited(w, Finished(gen1.plan.rank(w), generation=1)) for w in gen1.plan])
    assert m.Kill(spare) in s.actions
    assert s.core.state is DriverState.DONE


def test_spares_zero_starts_and_recovers_as_before():
    s = Script(min_workers=2, max_workers=4)
    s.send(m.HostsDiscovered(HOSTS))
    assert all(not a.spare for a in s.of(m.Spawn)) and len(s.of(m.Spawn)) == 4
    s.send(*[m.WorkerReady(a.worker_id) for a in s.of(m.Spawn)])
    [gen1] = s.of(m.Publish)
    s.sync(gen1)
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert len(gen2.plan) == 3 and [a.host for a in s.of(m.Spawn)] == ["C"] and not s.of(m.Spawn)[0].spare


def test_a_spare_on_the_node_that_just_failed_is_promoted_though_no_newcomer_may_start_there():
    """Only B has room for the spare; a member on B dies, so B cools down: the planner starts nobody there and A is
    full, but the spare booted on B already takes the place."""
    s = Script(min_workers=2, max_workers=4, spares=1)
    s.send(m.HostsDiscovered({"A": 2, "B": 3}))
    members, [spare] = spawns(s, False), spawns(s, True)
    assert spare.host == "B"
    s.send(*[m.WorkerReady(a.worker_id) for a in members], m.WorkerReady(spare.worker_id))
    [gen1] = s.of(m.Publish)
    s.sync(gen1)
    on_b = next(a.worker_id for a in members if a.host == "B")
    s.send(m.WorkerDied(on_b, "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert spare.worker_id in gen2.plan and len(gen2.plan) == 4
    assert s.of(m.Spawn) == [], "B cools down: no new spare there until it is offered again"
    s.send(m.Tick(), after=11.0)
    assert [(a.host, a.spare) for a in s.of(m.Spawn)] == [("B", True)]


def test_a_withdrawn_node_s_members_leave_and_the_ready_spare_takes_one_place_at_once():
    s, gen1, [spare] = running_with_a_ready_spare()
    s.send(m.HostsDiscovered({"A": 2, "C": 2}))
    s.send(m.HostsDiscovered({"A": 2, "C": 2}))  # the second poll confirms B is gone
    [gen2] = s.of(m.Publish)
    on_b = {w for w in gen1.plan if s.core.workers[w].host == "B"}
    assert spare in gen2.plan and not on_b & set(gen2.plan), "B's members leave, the spare joins in the same reset"
    assert [(a.host, a.spare) for a in s.of(m.Spawn)] == [("C", False)], "C's last slot: a newcomer for the 4th"
