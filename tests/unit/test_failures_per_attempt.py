"""`max_failures` counts failures of the run, as Ray Train does: one per attempt, nobody killed for a raise.

Replayed on the pure core (no Ray): ranks whose `train_fn` raised inside
`@elastic.run` stay in their processes and tell the driver
(`TrainFnRaised`); every rank that raises in one generation is one failure;
the ring re-forms with the same members, and only a worker that died is
replaced.
"""

from __future__ import annotations

from test_driver_core import Script

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.roster import ALIVE
from ray_elastic.protocol import DriverState, EventKind


def raised(worker: str, generation: int, error: str = "RuntimeError: intended") -> m.TrainFnRaised:
    return m.TrainFnRaised(worker, generation, error, f"Traceback (most recent call last):\n  ...\n{error}")


def test_every_rank_raising_in_one_attempt_is_one_failure_and_nobody_is_killed():
    s = Script(max_failures=1)
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(raised("w3", 1))
    # the others are told to leave their ring at once: they may be blocked in a collective with w3
    assert s.of(m.Abandon) == [m.Abandon(1, ("w1", "w2"), s.of(m.Abandon)[0].reason)]
    assert "retry 1 of max_failures=1" in s.of(m.Abandon)[0].reason
    [publish] = s.of(m.Publish)
    assert publish.generation == 2 and set(publish.plan) == {"w1", "w2", "w3"}, "the same members, the same ranks"
    assert [publish.plan[w].rank for w in ("w1", "w2", "w3")] == [0, 1, 2]
    # the other ranks raise too, in the same attempt (their messages come before and after the re-form)
    s.send(raised("w1", 1), raised("w2", 1))
    s.sync(publish)
    assert s.core.state is DriverState.RUNNING
    kinds = [e.kind for e in s.core.events]
    assert kinds == [EventKind.START, EventKind.RESET_REQUESTED]
    assert "w3" in s.core.events[-1].detail and "re-enters train_fn from the last commit" in s.core.events[-1].detail


def test_no_worker_is_killed_or_spawned_for_a_raise():
    s = Script(max_failures=2)
    s.start({"A": 1, "B": 1})
    actions = s.send(raised("w1", 1), raised("w2", 1))
    assert [a for a in actions if isinstance(a, (m.Kill, m.Spawn, m.Release))] == []
    assert s.core.record.roster.ids(*ALIVE) == {"w1", "w2"}


def test_a_second_attempts_raise_counts_again_and_spends_the_budget():
    s = Script(max_failures=1)
    s.start({"A": 1, "B": 1})
    s.send(raised("w2", 1))
    [gen2] = s.of(m.Publish)
    s.sync(gen2)
    s.send(raised("w1", 2, "ValueError: again"))
    assert s.core.state is DriverState.FAILED
    assert s.core.failure.startswith(
        "train_fn raised in worker w1 (rank 0 on node A): ValueError: again (max_failures=1 retries used up)"
    )
    assert "Traceback" in s.core.failure


def test_max_failures_zero_fails_at_the_first_raise_with_its_traceback():
    s = Script()
    s.start({"A": 1, "B": 1})
    s.send(raised("w2", 1, "KeyError: 'label'"))
    assert s.core.state is DriverState.FAILED and s.of(m.Publish) == []
    assert s.core.failure.startswith("train_fn raised in worker w2 (rank 1 on node B): KeyError: 'label'\nTraceback")


def test_a_death_and_a_raise_in_one_attempt_count_once():
    s = Script(max_failures=1, min_workers=1)
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerDied("w3", "ActorDiedError: SIGKILL", node_alive=True), raised("w2", 1))
    [gen2] = s.of(m.Publish)
    assert set(gen2.plan) == {"w1", "w2"}, "only the dead worker is gone"
    s.send(raised("w1", 1))  # the same attempt, told late
    s.sync(gen2)
    assert s.core.state is DriverState.RUNNING
    s.send(raised("w1", 2))  # the next attempt's raise is the second failure
    assert s.core.state is DriverState.FAILED and "max_failures=1 retries used up" in s.core.failure


def test_the_ring_errors_a_raise_causes_ask_nobody_and_kill_nobody():
    """The raising rank leaves its ring; its peers' ring errors must not make it a rank 'stuck in user code'."""
    s = Script(max_failures=1)
    s.start({"A": 1, "B": 1, "C": 1})
    # the peers' errors told with the raise, in one batch: explained by it, nobody is asked
    s.send(raised("w3", 1), m.ResetRequested("w1", 1, "Connection closed by peer"))
    assert s.of(m.QueryActivity) == [] and s.of(m.Kill) == []
    # told before the raise: the question is out, and its answers come after the re-form
    s = Script(max_failures=1)
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.ResetRequested("w1", 1, "Connection closed by peer"))
    [query] = s.of(m.QueryActivity)
    s.send(raised("w3", 1))
    [publish] = s.of(m.Publish)
    busy, idle = {"idle_s": 0.1, "in_collective": True}, {"idle_s": 15.0, "in_collective": False}
    s.send(m.ActivityReport(1, "w1", "closed", {"w1": busy, "w2": busy, "w3": idle}))
    assert s.of(m.Kill) == [], "w3 raised and waits to re-enter: it is not stuck in user code"
    s.sync(publish)
    assert s.core.state is DriverState.RUNNING and set(publish.plan) == {"w1", "w2", "w3"}


def test_a_raise_after_a_rank_returned_fails_the_run():
    """Rank 0 finished: the others cannot re-enter without it, so the raise ends the run with its traceback."""
    from ray_elastic.protocol import Finished

    s = Script(max_failures=3)
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w1", Finished(0, b"v")))
    s.send(raised("w2", 1, "OSError: disk full"))
    assert s.core.state is DriverState.FAILED and "OSError: disk full" in s.core.failure


def test_a_restarted_driver_keeps_the_count():
    """The count lives in the core, which the shell snapshots: a driver restart does not refill the budget."""
    import pickle

    s = Script(max_failures=1)
    s.start({"A": 1, "B": 1})
    s.send(raised("w2", 1))
    s.sync(s.of(m.Publish)[0])
    s.core = pickle.loads(pickle.dumps(s.core))
    s.send(raised("w2", 2))
    assert s.core.state is DriverState.FAILED


def test_raises_from_the_same_commit_are_bounded_by_max_failures_not_taken_for_a_crash_loop():
    """Three failure-driven resets from one commit are a crash loop, but raises have the user's own bound."""
    s = Script(max_failures=4)
    s.start({"A": 1, "B": 1})
    for generation in (1, 2, 3, 4):
        s.send(raised("w2", generation))
        [publish] = s.of(m.Publish)
        s.send(*[m.WorkerSynced(w, publish.generation, s.now + 1000.0, commits=0) for w in publish.plan])
        assert s.core.state is DriverState.RUNNING, s.core.failure
    s.send(raised("w1", 5))
    assert s.core.state is DriverState.FAILED and "max_failures=4 retries used up" in s.core.failure


def test_max_failures_minus_one_retries_without_limit():
    s = Script(max_failures=-1)
    s.start({"A": 1, "B": 1})
    for generation in range(1, 12):
        s.send(raised("w1", generation))
        [publish] = s.of(m.Publish)
        s.sync(publish)
    assert s.core.state is DriverState.RUNNING
    assert "retry 11 of max_failures=-1 (unlimited)" in s.core.events[-1].detail
