"""Six orderings that broke the run's invariants (issue 55), replayed on the driver's pure core.

Each script is one ordering a review found, mostly where a straggler let go
meets a membership change; each asserts what the user would see: the
trained state handed to the next generation by a worker that holds it,
never lost to a newcomer that did not sync, and a run that ends as its
ranks ended. No Ray, milliseconds each.
"""

from __future__ import annotations

from test_driver_core import Script
from test_pace_watch import paces

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.roster import WorkerStatus
from ray_elastic.protocol import DriverState, EventKind, Finished, Removed


def rank0(publish: m.Publish) -> str:
    return next(w for w, slot in publish.plan.items() if slot.rank == 0)


def holds(s: Script, worker_id: str) -> bool:
    return s.core.workers[worker_id].holds_state


def test_a_withdrawn_pool_keeps_the_worker_holding_the_state_not_the_oldest_newcomer():
    """1. w3 (older, never synced) was kept over w4 (the only holder) and became rank 0 alone."""
    s = Script(min_workers=1, max_workers=4)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1, "D": 1}))
    assert [a.worker_id for a in s.of(m.Spawn)] == ["w3", "w4"]
    s.send(m.WorkerReady("w4"), m.WorkerDied("w2", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert list(gen2.plan) == ["w1", "w4"]
    s.sync(gen2)
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True), m.WorkerReady("w3"))
    [gen3] = s.of(m.Publish)
    assert rank0(gen3) == "w4" and set(gen3.plan) == {"w3", "w4"}
    s.send(m.HostsDiscovered({"E": 1}))
    s.send(m.HostsDiscovered({"E": 1}))  # C and D withdrawn for good while w3 still syncs
    for publish in s.of(m.Publish):
        assert holds(s, rank0(publish)), f"generation {publish.generation}: rank 0 {rank0(publish)} never synced"
    assert s.core.workers["w4"].status is WorkerStatus.MEMBER, "the only holder stays until the state is handed over"
    assert s.core.state is not DriverState.FAILED, s.core.failure


def test_a_straggler_let_go_as_the_other_holders_host_is_withdrawn_does_not_leave_a_newcomer_as_rank0():
    """2. w1 let go as a straggler counted as staying in the hold-over; w2 (withdrawn) left: {w3} never synced."""
    s = Script(min_workers=1, max_workers=3)
    gen1 = s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "C": 1}))
    [spawn] = s.of(m.Spawn)
    published = [a for a in s.send(m.HostsDiscovered({"A": 1, "C": 1}), *paces(s, 1, {"w1": 3.0}, gen1.plan))]
    # judged a straggler; kept while w2 (withdrawn) stays only to hand the state on and the newcomer boots
    assert "w1" in s.core.record.evicted, "the paces made w1 a straggler"
    published += s.send(m.WorkerReady(spawn.worker_id))
    published = [a for a in published if isinstance(a, m.Publish)]
    assert spawn.worker_id in published[-1].plan, "the newcomer is admitted"
    for publish in published:
        assert holds(s, rank0(publish)), f"generation {publish.generation}: rank 0 {rank0(publish)} never synced"
    assert s.core.state is not DriverState.FAILED, s.core.failure


def test_a_straggler_let_go_as_the_other_holder_dies_stays_to_hand_the_state_over():
    """3. w1 slow and w2 dead in one batch: {w3} never synced became rank 0 while w1, holding the state, lived."""
    s = Script(min_workers=1, max_workers=4)
    gen1 = s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1, "D": 1}))
    s.send(m.WorkerReady("w3"))  # w4 still boots
    assert s.of(m.Publish) == []
    s.send(*paces(s, 1, {"w1": 3.0}, gen1.plan), m.WorkerDied("w2", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert rank0(gen2) == "w1" and "w3" in gen2.plan, "the straggler holds the state: it hands it over first"
    s.sync(gen2)
    s.send(m.WorkerReady("w4"))
    [gen3] = s.of(m.Publish)
    assert "w1" not in gen3.plan and holds(s, rank0(gen3)), "once handed over, the straggler leaves"
    assert s.core.state is not DriverState.FAILED, s.core.failure


def test_a_checkpoint_lookup_answered_after_a_holder_came_back_is_ignored():
    """4. The late word that w4 synced brought a holder back; the lookup's 'none' then failed the run."""
    for answer in (
        m.CheckpointFound(False),
        m.CheckpointFound(False, error="storage timed out"),
        m.CheckpointFound(True),
    ):
        s = Script(min_workers=2, max_workers=4, checkpoint_dir="file:///tmp/ckpt")
        s.start({"A": 1, "B": 1})
        s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1, "D": 1}))
        s.send(m.WorkerReady("w4"))
        s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True))
        [gen2] = s.of(m.Publish)
        s.send(m.WorkerSynced("w1", gen2.generation, s.now + 1000.0))
        s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True))
        assert s.of(m.LookForCheckpoint) == [m.LookForCheckpoint()]
        s.send(m.WorkerSynced("w4", gen2.generation, s.now + 1000.0), m.WorkerReady("w3"))  # w4's word, late
        [gen3] = s.of(m.Publish)
        assert rank0(gen3) == "w4"
        s.send(answer)
        assert s.core.state is not DriverState.FAILED, (answer, s.core.failure)
        assert s.core.generation == gen3.generation and s.of(m.Publish) == [], answer
        assert EventKind.RESTARTED not in [e.kind for e in s.core.events], answer


def test_a_let_go_newcomers_messages_change_nothing_and_the_run_ends_with_rank0s_value():
    """5. w3, let go as the ranks returned, still counted: its ring's error and its answer failed the run."""
    orders = [
        ("reset", "w2", "activity", "w1"),
        ("reset", "w2", "w1", "activity"),
        ("w2", "reset", "w1"),
        ("w2", "reset", "activity", "w1"),
    ]
    for order in orders:
        s = Script(max_workers=3)
        s.start({"A": 1, "B": 1})
        s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
        s.send(m.WorkerReady("w3"))
        [gen2] = s.of(m.Publish)
        assert "w3" in gen2.plan  # w1 and w2 return from generation 1's last step and never join it
        said = {
            "reset": m.ResetRequested("w3", gen2.generation, "timed out waiting for rank 0"),
            "activity": m.ActivityReport(gen2.generation, "w3", "timed out", {"w3": "timeout"}),
            "w1": m.WorkerExited("w1", Finished(0, "rank 0's model", generation=1)),
            "w2": m.WorkerExited("w2", Finished(1, generation=1)),
        }
        for step in order:
            s.send(said[step])
        assert s.core.state is DriverState.DONE, (order, s.core.failure)
        assert s.core.return_value == "rank 0's model", order


def test_max_workers_1_hands_the_state_over_to_a_newcomer_on_the_new_host():
    """6. The held-over worker took the only slot: nothing ever started on B, and w1 stayed on withdrawn A."""
    s = Script(min_workers=1, max_workers=1)
    s.start({"A": 1})
    spawned = []
    for _ in range(3):  # A withdrawn, confirmed, and again
        spawned += [a for a in s.send(m.HostsDiscovered({"B": 1})) if isinstance(a, m.Spawn)]
    [spawn] = spawned
    assert spawn.host == "B" and s.core.workers["w1"].status is WorkerStatus.MEMBER
    s.send(m.WorkerReady(spawn.worker_id))
    [handover] = s.of(m.Publish)
    assert rank0(handover) == "w1" and set(handover.plan) == {"w1", spawn.worker_id}
    s.sync(handover)
    [alone] = s.of(m.Publish)
    assert list(alone.plan) == [spawn.worker_id] and holds(s, spawn.worker_id)
    assert s.core.workers["w1"].status is WorkerStatus.LEAVING
    assert s.core.state is not DriverState.FAILED, s.core.failure


def test_a_newcomer_that_never_boots_does_not_fail_a_run_whose_min_workers_are_ready():
    """Found by the model: one stuck boot held generation 1 back until elastic_timeout, and the run failed as
    'min_workers=2 not reached (ready workers: 2)'; its boot deadline, as long, came a tick too late."""
    s = Script(min_workers=2)
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    s.send(m.WorkerReady("w1"), m.WorkerReady("w2"))  # w3 never says it is ready
    actions = []
    for _ in range(8):
        actions += s.send(m.Tick(), after=10.0)
    assert s.core.state is DriverState.RUNNING, s.core.failure
    assert [list(a.plan) for a in actions if isinstance(a, m.Publish)] == [["w1", "w2"]]
    assert m.Kill("w3", failed=True) in actions and "w3" not in s.core.alive_ids(), "killed at its boot deadline"


def test_a_straggler_let_go_as_another_member_dies_stays_while_the_world_would_be_below_min_workers():
    """Found by the model: w2 let go (3 members, min 2), w3 dead in the same batch: the run waited with w1 alone
    until elastic_timeout while w2, slow but working, was sent away."""
    s = Script(min_workers=2, max_workers=3)
    gen1 = s.start({"A": 1, "B": 1, "C": 1})
    s.send(*paces(s, 1, {"w2": 3.0}, gen1.plan), m.WorkerDied("w3", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert list(gen2.plan) == ["w1", "w2"] and s.core.state is DriverState.RESETTING
    s.sync(gen2)
    s.send(m.Tick(), after=11.0)  # C cooled down: a newcomer replaces w3
    [spawn] = s.of(m.Spawn)
    s.send(m.WorkerReady(spawn.worker_id))
    [gen3] = s.of(m.Publish)
    assert set(gen3.plan) == {"w1", spawn.worker_id}, "with min_workers back, the straggler leaves"
    assert s.core.failure is None


def test_a_leaving_member_of_a_generation_given_up_for_a_durable_restart_is_told_and_the_run_can_end():
    """Found by the model: the restart emptied the plan without telling w2 (leaving a draining node); it never
    exited, and the run, whose ranks all returned, never ended."""
    s = Script(min_workers=1, max_workers=2, checkpoint_dir="file:///tmp/ckpt", cooldown_range=(1.0, 1.0))
    s.start({"A": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1}))
    s.send(m.WorkerReady("w2"))
    [gen2] = s.of(m.Publish)
    s.send(m.NodesDraining({"B": 0.0}), m.WorkerDied("w1", "SIGKILL", node_alive=True))  # before w2 synced
    s.send(m.CheckpointFound(True))
    [spawn] = s.send(m.Tick(), after=1.5)[:1]
    s.send(m.WorkerReady(spawn.worker_id))
    [gen3] = s.of(m.Publish)
    assert "w2" in gen3.notify and "w2" not in gen3.plan, "the member left out is told, so it exits"
    s.send(m.WorkerExited("w2", Removed()))
    s.sync(gen3)
    s.send(m.WorkerExited(spawn.worker_id, Finished(0, "resumed model", generation=gen3.generation)))
    assert s.core.state is DriverState.DONE and s.core.return_value == "resumed model"


def test_a_replacement_for_a_boot_that_failed_does_not_hold_back_newcomers_that_are_ready():
    """Found by the model: each replacement of a boot that failed held the ready newcomers back for another
    elastic_timeout; with boots that keep failing, for ever."""
    s = Script(min_workers=1, max_workers=3)
    s.start({"A": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1, "D": 1}))
    assert [a.host for a in s.of(m.Spawn)] == ["B", "C"]
    s.send(m.WorkerReady("w2"))  # w3 on C never boots
    assert s.of(m.Publish) == [], "newcomers started together are admitted together"
    s.send(m.Tick(), after=61.0)  # w3 killed at its boot deadline; its replacement starts on D at once
    assert [a.host for a in s.of(m.Spawn)] == ["D"]
    [gen2] = s.of(m.Publish)
    assert list(gen2.plan) == ["w1", "w2"], "w2 is admitted without waiting for the replacement's boot"
