"""Orderings the shell can send but the model did not generate, each a defect of the core found by review.

Each test replays the script that broke the pure core (no Ray) and asserts
what the user should see instead.
"""

from __future__ import annotations

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
