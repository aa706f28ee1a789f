"""Orderings the shell can send but the model did not generate, each a defect of the core found by review.

Each test replays the script that broke the pure core (no Ray) and asserts
what the user should see instead.
"""

from __future__ import annotations

import pytest
from test_driver_core import Script

from ray_elastic.driver.core import messages as m
from ray_elastic.protocol import DriverState

BUSY = {"idle_s": 0.1, "in_collective": True}


def _generation_two_with_a_newcomer_syncing() -> Script:
    """min_workers=3; generation 2 is w1 (rank 0) and w2 on node B, both holders, and w4, a newcomer still syncing."""
    s = Script(min_workers=3, max_workers=3, checkpoint_dir="file:///tmp/ray-elastic-defects")
    s.start({"B": 2, "C": 1})
    s.send(m.WorkerDied("w3", "node lost", node_alive=False), m.HostsDiscovered({"B": 2, "D": 1}))
    s.send(*[m.WorkerReady(a.worker_id) for a in s.of(m.Spawn)])
    [publish] = s.of(m.Publish)
    assert publish.generation == 2 and sorted(publish.plan) == ["w1", "w2", "w4"]
    s.send(m.WorkerSynced("w1", 2, s.now + 1000), m.WorkerSynced("w2", 2, s.now + 1000))
    return s


def test_activity_answers_after_a_durable_restart_dropped_the_ring_neither_raise_nor_kill():
    """The activity question outlives the ring: a restart from the checkpoint forgot its members meanwhile.

    Before the fix the verdict killed w2, whom the roster had forgotten, and
    the core raised `KeyError: 'w2'`: the run failed as an internal error of
    the driver instead of resuming from its checkpoint.
    """
    s = _generation_two_with_a_newcomer_syncing()
    s.send(m.ResetRequested("w4", 2, "timed out"))
    [query] = s.of(m.QueryActivity)
    assert set(query.worker_ids) == {"w1", "w2", "w4"}
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True))  # below min_workers: waiting
    silent = m.CpuSample(0.0, 0.5, "S")  # no CPU: hung
    s.send(m.PingResults(frozenset({"w4"}), frozenset({"w2"}), s.now - 5.0, {"w2": silent}), after=6.0)
    assert m.Kill("w2", failed=True) in s.actions and s.of(m.LookForCheckpoint)
    s.send(m.CheckpointFound(True))  # every holder lost: a restart from the checkpoint drops generation 2
    s.send(m.ActivityReport(2, "w4", "timed out", {"w1": m.ACTIVITY_ERROR, "w2": m.ACTIVITY_TIMEOUT, "w4": BUSY}))
    assert s.core.state is not DriverState.FAILED, s.core.failure
    assert s.of(m.Kill) == []


def test_a_ring_error_after_a_durable_restart_asks_no_empty_question():
    """A survivor's word about the dropped ring must not re-form it (one reset too many, newcomers not awaited)."""
    s = _generation_two_with_a_newcomer_syncing()
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True), m.WorkerDied("w2", "SIGKILL", node_alive=True))
    s.send(m.CheckpointFound(True))
    s.send(m.ResetRequested("w4", 2, "Connection closed by peer"))
    assert s.of(m.QueryActivity) == [] and s.of(m.Publish) == []


def test_a_straggler_let_go_is_kept_while_the_only_other_member_stays_just_to_hand_the_state_on():
    """min 2, max 3. w3 is judged a straggler as w1 dies (kept: min_workers); B drains, so w2 stays only as the
    holder; a newcomer on D is ready. Before the fix, generation 3 was {w2, w4}: w3 was let go because w2 was
    counted as staying, and once w2 handed the state on the run had one worker and waited out cool-downs."""
    from test_pace_watch import paces

    s = Script(min_workers=2, max_workers=3)
    gen1 = s.start({"A": 1, "B": 1, "C": 1})
    s.send(*paces(s, 1, {"w3": 3.0}, gen1.plan), m.WorkerDied("w1", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    s.sync(gen2)
    s.send(m.NodesDraining({"B": 0.0}))
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1, "D": 1}))
    [spawn] = s.of(m.Spawn)
    s.send(m.WorkerReady(spawn.worker_id))
    [gen3] = s.of(m.Publish)
    assert set(gen3.plan) == {"w2", "w3", spawn.worker_id}, "the straggler stays while w2 only hands the state on"
    s.sync(gen3)
    plans = [set(a.plan) for a in s.actions if isinstance(a, m.Publish)]
    s.send(m.Tick(), after=1.0)
    plans += [set(a.plan) for a in s.actions if isinstance(a, m.Publish)]
    assert plans and plans[-1] == {"w3", spawn.worker_id}, "w2 leaves; the world stays at min_workers"
    assert s.core.state is DriverState.RESETTING or s.core.state is DriverState.RUNNING


def test_a_liveness_round_older_than_one_taken_changes_nothing():
    """Found by the model once it generated busy members: a round delivered late (after a newer one in which the
    member answered) made the member silent since the old round, and, past collective_timeout, killed it."""
    s = Script(min_workers=1, collective_timeout=20.0)
    s.start({"A": 1, "B": 1})
    busy = m.CpuSample(0.5, 0.5, "R")
    old = m.PingResults(frozenset({"w1"}), frozenset({"w2"}), s.now - 5.0, {"w2": busy})
    s.send(m.PingResults(frozenset({"w1", "w2"}), frozenset(), s.now, {}), after=1.0)  # the newer round: it answers
    s.send(old, after=60.0)  # the older round, delivered last
    assert s.of(m.Kill) == [] and s.core.workers["w2"].status.value == "member"


def a_newcomer_booting() -> tuple[Script, str]:
    """Two members training on nodes A and B, and a newcomer starting on node C (max_workers=3)."""
    s = Script(min_workers=2, max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    [spawn] = s.of(m.Spawn)
    return s, spawn.worker_id


def test_a_newcomer_stopped_before_its_first_answer_is_killed_in_a_round_not_after_elastic_timeout():
    """The chaos soak's unreported hang: it stopped a newcomer (w27) whose process was up but had not answered
    a ping yet. The core skipped every never-answered worker, so only the boot deadline (`elastic_timeout`,
    600 s by default) bounded it: the run finished around it, and no event ever named it. A reading that shows
    its process stopped now judges it; one that could not be taken (no process yet) still waits for the
    deadline."""
    s, starting = a_newcomer_booting()
    s.send(m.PingResults(frozenset(), frozenset({starting}), s.now, {starting: "its process id is not known yet"}))
    assert s.of(m.Kill) == [], "no process to read yet: the boot deadline bounds it"
    stopped = m.CpuSample(0.0, 0.5, "T")
    s.send(m.PingResults(frozenset(), frozenset({starting}), s.now, {starting: stopped}), after=2.0)
    assert m.Kill(starting, failed=True) in s.actions
    failed = [e for e in s.core.events if e.kind.value == "newcomer_failed"]
    assert failed and f"worker {starting} " in failed[-1].detail and "hung" in failed[-1].detail
    s.send(m.Tick(), after=11.0)
    assert [a.host for a in s.of(m.Spawn)] == ["C"], "a replacement starts once its node's cool-down ends"


@pytest.mark.parametrize("state", ["S", "R", "D"])
def test_a_newcomer_booting_with_little_cpu_is_left_to_its_boot_deadline_not_killed(state):
    """Found by a stress run of horovod's elastic example on a loaded machine: every newcomer that
    had not answered its first ping was read sleeping with 2-4% of a CPU (waiting on a starved raylet for its
    task) and killed as hung; their nodes cooled down 40 s, then 80 s, and the run waited with no world. A
    boot sleeps or waits for the machine most of its time: only a stopped process is judged before its first
    answer."""
    s, booting = a_newcomer_booting()
    for _ in range(5):
        reading = m.CpuSample(0.01, 0.5, state)
        s.send(m.PingResults(frozenset(), frozenset({booting}), s.now, {booting: reading}), after=2.0)
    assert m.Kill(booting, failed=True) not in s.actions
    assert not [e for e in s.core.events if e.kind.value == "newcomer_failed"]
    s.send(m.PingResults(frozenset({booting}), frozenset(), s.now, {}), after=1.0)
    s.send(m.PingResults(frozenset(), frozenset({booting}), s.now, {booting: m.CpuSample(0.0, 0.5, "S")}), after=2.0)
    assert m.Kill(booting, failed=True) in s.actions, "once it answered, a silent sleeping worker is hung"


def test_ranks_that_return_after_their_peers_ring_broke_and_was_formed_again_fail_the_run_at_once():
    """Found by bench/boot_phases.py, whose loop let each rank check a stop file on its own: two ranks saw it and
    returned from train_fn; the two others' collective broke on them; their word came first, so generation 2 was
    formed again with all four. The returns, about generation 1, found no ring error told in generation 2, and
    the run hung until the other two's rendezvous timed out (collective_timeout, 300 s by default) instead of
    failing at once as an uneven finish."""
    from ray_elastic.protocol import Finished

    s = Script(min_workers=2, max_workers=4)
    gen1 = s.start({"A": 2, "B": 2})
    s.send(
        m.ResetRequested("w1", 1, "Connection reset by peer"), m.ResetRequested("w4", 1, "Connection closed by peer")
    )
    assert s.of(m.QueryActivity)
    returned = {"idle_s": 0.2, "in_collective": False}
    answers = {"w1": BUSY, "w2": returned, "w3": returned, "w4": BUSY}
    s.send(m.ActivityReport(1, "w1", "Connection reset by peer", answers))
    [gen2] = s.of(m.Publish)
    assert gen2.generation == 2 and set(gen2.plan) == set(gen1.plan)
    s.send(
        m.WorkerExited("w2", Finished(gen1.plan.rank("w2"), generation=1)),
        m.WorkerExited("w3", Finished(gen1.plan.rank("w3"), generation=1)),
    )
    assert s.core.state is DriverState.FAILED, "the ranks did not finish together: the run fails now"
    assert "returned from train_fn while" in (s.core.failure or "") and "w1" in s.core.failure
