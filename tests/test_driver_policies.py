"""The driver's judgement calls, each a pure function returning its decision and the reason it gives."""

from __future__ import annotations

from ray_elastic.driver.messages import ACTIVITY_ERROR, ACTIVITY_TIMEOUT
from ray_elastic.driver.policies import (
    PublishVerdict,
    Ring,
    decide_crash_loop,
    decide_publish,
    decide_user_error,
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
