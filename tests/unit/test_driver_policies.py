"""The driver's judgement calls, each a pure function returning its decision and the reason it gives."""

from __future__ import annotations

from ray_elastic.driver.core.messages import ACTIVITY_ERROR, ACTIVITY_TIMEOUT, CpuSample
from ray_elastic.driver.core.policies import (
    PublishVerdict,
    Ring,
    decide_crash_loop,
    decide_publish,
    decide_user_error,
    judge_missed_ping,
    judge_ring_failure,
)


def publish(**overrides):
    values = {"current": ["w1", "w2"], "ready": ["w1", "w2"], "alive": ["w1", "w2"], "leaving": [], "starting": 0}
    values.update(overrides)
    return decide_publish(min_workers=2, **values)


def test_publish_verdicts_and_their_reasons():
    assert publish()[0] is PublishVerdict.UNCHANGED
    assert publish(force=True) == (
        PublishVerdict.NOW,
        "the ring broke: 2 worker(s) form the next generation",
    )
    assert publish(ready=["w1", "w2", "w3"], starting=1) == (
        PublishVerdict.WAIT_FOR_BOOT,
        "1 newcomer(s) still booting; they are admitted together",
    )
    # a death does not wait for booting newcomers: the survivors' ring is broken now
    verdict, reason = publish(ready=["w1", "w3"], alive=["w1", "w3", "w4"], starting=1)
    assert verdict is PublishVerdict.NOW and reason.startswith("the membership changed")
    # nor does a graceful removal
    assert publish(ready=["w1", "w3"], leaving=["w2"], starting=1)[0] is PublishVerdict.NOW
    assert publish(ready=["w1"], alive=["w1"]) == (
        PublishVerdict.BELOW_MIN,
        "1 ready worker(s), fewer than min_workers=2",
    )
    assert publish(ready=["w3", "w4"], alive=["w3", "w4"]) == (
        PublishVerdict.ALL_LOST,
        "all 2 workers of the current generation were lost",
    )
    # members alive, but the only ones holding the trained state are gone: a newcomer's state must not win
    holders = {"w1", "w2"}
    assert publish(current=["w1", "w2", "w4"], ready=["w3", "w4"], alive=["w3", "w4"], holds=holders.__contains__) == (
        PublishVerdict.ALL_LOST,
        "every worker holding the trained state was lost (w1, w2)",
    )
    verdict, _ = publish(current=["w1", "w2", "w4"], ready=["w2", "w4"], alive=["w2", "w4"], holds=holders.__contains__)
    assert verdict is PublishVerdict.NOW, "one holder alive is enough: it becomes rank 0"


def test_user_errors_are_retried_only_within_max_failures():
    assert decide_user_error(0, 2) == (True, "retry 1 of max_failures=2")
    assert decide_user_error(2, 2) == (False, "max_failures=2 retries used up")
    assert decide_user_error(0, 0) == (False, "max_failures=0: a train_fn exception ends the run")


BUSY = {"idle_s": 0.5, "in_collective": True}


def judge(activity, last=None, now=100.0):
    return judge_ring_failure(activity, collective_timeout=20.0, liveness_timeout=5.0, last_timeout_reset=last, now=now)


def test_a_member_that_does_not_answer_is_hung():
    verdict = judge({"w1": BUSY, "w2": ACTIVITY_TIMEOUT})
    assert verdict == (Ring.KILL, "w2 did not answer within liveness_timeout=5 s", ("w2",))


def test_a_dead_member_explains_the_broken_ring():
    assert judge({"w1": BUSY, "w2": ACTIVITY_ERROR}).verdict is Ring.IGNORE


def test_a_member_outside_collectives_for_half_the_timeout_is_stuck_in_user_code():
    verdict = judge({"w1": BUSY, "w2": {"idle_s": 10.5, "in_collective": False}})
    assert verdict == (Ring.KILL, "w2 made no collective call for over 10 s while the others timed out", ("w2",))
    # idle but recently active: not stuck
    assert judge({"w1": BUSY, "w2": {"idle_s": 9.0, "in_collective": False}}).verdict is Ring.REFORM


def test_everyone_busy_re_forms_once_then_fails_as_a_mismatch():
    assert judge({"w1": BUSY, "w2": BUSY}).verdict is Ring.REFORM
    again = judge({"w1": BUSY, "w2": BUSY}, last=50.0, now=100.0)
    assert again.verdict is Ring.FAIL and "collectives do not match" in again.reason
    # long after the last one (3 collective timeouts): a new story, re-formed again
    assert judge({"w1": BUSY, "w2": BUSY}, last=30.0, now=100.0).verdict is Ring.REFORM


def test_three_failures_resuming_from_the_same_commit_are_a_crash_loop():
    assert decide_crash_loop([5, 5], ["a", "a"])[0] is False
    assert decide_crash_loop([4, 5, 5], ["a", "a", "a"])[0] is False
    loop, reason = decide_crash_loop([4, 5, 5, 5], ["x", "boom", "boom", "bang"])
    assert loop and "resuming from the same commit (5)" in reason and reason.endswith("(causes: boom; bang)")


def missed(sample, silent_for=10.0):
    return judge_missed_ping(sample, silent_for=silent_for, liveness_timeout=2.0, collective_timeout=300.0)


def test_a_silent_member_whose_thread_computes_is_busy_not_hung():
    busy, reason = missed(CpuSample(busiest_thread_s=0.49, window_s=0.5, state="R"))
    assert busy
    assert reason == (
        "did not answer within liveness_timeout=2 s but is computing (98% of a CPU over 0.5 s): busy in a call "
        "that holds the GIL; spared while it computes, up to collective_timeout=300 s of silence"
    )
    # a computing thread sharing a core with several others is still computing
    assert missed(CpuSample(busiest_thread_s=0.1, window_s=0.5, state="R"))[0]


def test_a_silent_member_without_cpu_use_or_without_a_reading_is_hung():
    busy, reason = missed(CpuSample(busiest_thread_s=0.0, window_s=0.5, state="T"))
    assert not busy
    assert (
        reason
        == "did not answer within liveness_timeout=2 s and used no CPU (0% of a CPU over 0.5 s, process stopped): hung"
    )
    # Ray's own threads tick now and then in a hung worker (measured: at most one 10 ms tick in 0.5 s)
    assert not missed(CpuSample(busiest_thread_s=0.01, window_s=0.5, state="S"))[0]
    busy, reason = missed("no reading within 2 s (its node may be unreachable)")
    assert not busy
    assert reason == (
        "did not answer within liveness_timeout=2 s, and its CPU time could not be read: no reading within 2 s "
        "(its node may be unreachable)"
    )


def test_a_silent_member_starved_of_cpu_or_waiting_on_a_disk_is_spared_not_killed():
    """Under full CPU load a live worker's ping can miss `liveness_timeout` while its threads wait their turn
    (runnable, state R, little CPU): killing it would be a false positive. A disk wait (D) is the same."""
    busy, reason = missed(CpuSample(busiest_thread_s=0.01, window_s=0.5, state="R"))
    assert busy
    assert reason.startswith("did not answer within liveness_timeout=2 s with little CPU (2% over 0.5 s), but its ")
    assert "process running: waiting for the machine" in reason
    assert missed(CpuSample(busiest_thread_s=0.0, window_s=0.5, state="D"))[0]
    busy, reason = missed(CpuSample(busiest_thread_s=0.0, window_s=0.5, state="D"), silent_for=301.0)
    assert not busy and reason.endswith("though it is waiting for the machine (process waiting on I/O)")


def test_a_member_computing_but_silent_past_collective_timeout_is_killed():
    busy, reason = missed(CpuSample(busiest_thread_s=0.5, window_s=0.5, state="R"), silent_for=301.0)
    assert not busy
    assert reason == (
        "has not answered for 301 s, longer than collective_timeout=300 s, though it is computing (100% of a CPU)"
    )
