"""The driver's judgement calls, as pure functions that return a decision and its reason.

- `decide_publish`: whether the membership changed so that a new generation
  must form now, must wait (newcomers still booting, too few workers), or
  cannot form because every holder of the trained state is gone.
- `decide_user_error`: whether an exception raised by `train_fn` is retried
  as that worker's failure (`max_failures`) or ends the run.
- `judge_ring_failure`: a ring broke while no death explains it; from the
  members' activity and the errors the ranks raised, tell a hung member, a
  member stuck in user code (a deadlock), a repeated mismatch (timeouts), an
  error that repeats (quoted, with its rank), and a one-off failure apart.
- `judge_missed_ping`: whether a member that did not answer a ping is
  hung (kill it) or busy in a long call that holds the GIL (spare it, up to
  `collective_timeout`), from its threads' CPU time.

The reason is the text the driver logs, puts in the event and, for a
failure, raises: one string, so the three always agree.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple

from ray_elastic.driver.core.messages import ACTIVITY_ERROR, ACTIVITY_TIMEOUT, CpuSample


class PublishVerdict(enum.Enum):
    UNCHANGED = "unchanged"  # the members are the current generation: nothing to do
    ALL_LOST = "all_lost"  # no worker alive holds the trained state: only a durable checkpoint helps
    HOLDER_LEAVING = "holder_leaving"  # holders live but would all leave: never publish a plan without one
    WAIT_FOR_BOOT = "wait_for_boot"  # newcomers still start: admit them together once they are ready
    BELOW_MIN = "below_min"  # fewer than min_workers ready: wait for more
    NOW = "now"  # publish the next generation


def decide_publish(
    *,
    current: Collection[str],
    ready: Collection[str],
    alive: Collection[str],
    leaving: Collection[str],
    starting: int,
    min_workers: int,
    force: bool = False,
    holds: Callable[[str], bool] = lambda worker_id: False,
) -> tuple[PublishVerdict, str]:
    """Whether to publish a new generation.

    `current` are the current generation's members, `ready` the workers that
    would form the next one (members still alive and ready newcomers),
    `alive` every worker whose process may still run, `leaving` the members
    discovery withdrew, `starting` the number of newcomers still booting;
    `force` re-forms the ring even with the same members (it broke);
    `holds(w)` whether member `w` finished a sync, so holds the trained state.
    A next generation whose members hold none of it would hand a newcomer's
    untrained state to everyone: that is `ALL_LOST` when no holder lives,
    `HOLDER_LEAVING` when the holders that live all leave; never `NOW`.
    """
    # the sizes first: at thousands of workers most changes are told by them, without building two sets
    if not force and (ready is current or (len(ready) == len(current) and set(ready) == set(current))):
        return PublishVerdict.UNCHANGED, "the membership is unchanged"
    if current and not any(w in alive for w in current):
        return PublishVerdict.ALL_LOST, f"all {len(current)} workers of the current generation were lost"
    # both scans stop at the first holder alive: rank 0, nearly always
    if any(map(holds, current)) and not any(w in alive for w in current if holds(w)):
        held = ", ".join(w for w in current if holds(w))
        return PublishVerdict.ALL_LOST, f"every worker holding the trained state was lost ({held})"
    if any(map(holds, current)) and not any(map(holds, ready)):
        held = ", ".join(w for w in current if holds(w) and w in alive)
        return PublishVerdict.HOLDER_LEAVING, f"every worker holding the trained state is leaving ({held})"
    # a member lost or leaving: asked only while newcomers boot (a scan of the members)
    if starting and not (force or any(w not in alive for w in current) or any(w in current for w in leaving)):
        return PublishVerdict.WAIT_FOR_BOOT, f"{starting} newcomer(s) still booting; they are admitted together"
    if len(ready) < min_workers:
        return PublishVerdict.BELOW_MIN, f"{len(ready)} ready worker(s), fewer than min_workers={min_workers}"
    what = "the ring broke" if force and set(ready) == set(current) else "the membership changed"
    return PublishVerdict.NOW, f"{what}: {len(ready)} worker(s) form the next generation"


def decide_user_error(failures_so_far: int, max_failures: int, retryable: bool = True) -> tuple[bool, str]:
    """Retry a failure of the run (an attempt in which `train_fn` raised) while `max_failures` allows it.

    As Ray Train's `FailureConfig(max_failures=)`: -1 is unlimited, 0 fails
    at the first. A mistake that running again would repeat
    (`retryable=False`) is never retried.
    """
    if not retryable:
        return False, "not retried: running again would repeat it"
    if max_failures < 0:
        return True, f"retry {failures_so_far + 1} of max_failures=-1 (unlimited)"
    if failures_so_far < max_failures:
        return True, f"retry {failures_so_far + 1} of max_failures={max_failures}"
    if max_failures:
        return False, f"max_failures={max_failures} retries used up"
    return False, "max_failures=0: a train_fn exception ends the run"


class Ring(enum.Enum):
    IGNORE = "ignore"  # a death explains it: its own message re-forms the ring
    KILL = "kill"  # kill these members (hung, or stuck outside collectives): their deaths re-form the ring
    REFORM = "reform"  # everyone alive and inside collectives: re-form the ring once
    FAIL = "fail"  # it broke again the same way: a mismatch that re-forming would repeat forever


class RingVerdict(NamedTuple):
    verdict: Ring
    reason: str
    kill: tuple[str, ...] = ()


class RingError(NamedTuple):
    """What one rank told the driver when its ring broke: the error its collective raised."""

    rank: int
    worker_id: str
    error: str


_TIMEOUT = re.compile(r"timed out|timeout|did not finish within", re.IGNORECASE)
# a peer's failure seen from this side: the consequence, not the cause, when both repeat
_ECHO = re.compile(r"connection (reset|closed)|closed by peer|abandoned|^collective failed$", re.IGNORECASE)


def is_timeout(error: str) -> bool:
    """Whether a ring error says a collective ran out of time (rather than failed at once)."""
    return bool(_TIMEOUT.search(error))


def _shape(error: str) -> str:
    """An error's text without its numbers (addresses, ports, pointers, pids): the same failure reads the same."""
    return re.sub(r"0x[0-9a-f]+|\d+", "#", " ".join(error.lower().split()))


def repeated_error(previous: Sequence[RingError], current: Sequence[RingError]) -> RingError | None:
    """The current generation's error that the previous generation raised too (a cause before its echoes)."""
    before = {_shape(e.error) for e in previous}
    again = [e for e in current if _shape(e.error) in before]
    again.sort(key=lambda e: (bool(_ECHO.search(e.error)), e.rank))
    return again[0] if again else None


def _quoted(e: RingError) -> str:
    text = " ".join(e.error.split())
    return f"rank {e.rank} ({e.worker_id}) raised: {text[:600]!r}"


def judge_ring_failure(
    activity: Mapping[str, Mapping[str, Any] | str],
    *,
    collective_timeout: float,
    liveness_timeout: float,
    last_timeout_reset: float | None,
    now: float,
    errors: Sequence[RingError] = (),
    previous_errors: Sequence[RingError] = (),
) -> RingVerdict:
    """Decide what a broken ring with every member alive means.

    A member that did not answer within `liveness_timeout` is hung: kill it.
    A member that answers but has not touched a collective for half the
    collective timeout while the others timed out is stuck in user code
    (a deadlock): kill it. Otherwise re-form the ring, unless it already
    broke within three collective timeouts: re-forming would loop forever,
    so the run fails, saying why from `errors` (what the ranks raised in
    this generation; `previous_errors` in the one before). Collectives that
    timed out with every rank inside one are a mismatch (a deadlock in
    train_fn); an error that repeats is quoted with the rank that raised
    it (a GPU or a transport refusing the ring fails within milliseconds,
    every generation: no timeout, no deadlock).
    """
    hung = tuple(w for w, a in activity.items() if a == ACTIVITY_TIMEOUT)
    if hung:
        return RingVerdict(
            Ring.KILL, f"{', '.join(hung)} did not answer within liveness_timeout={liveness_timeout:g} s", hung
        )
    if any(a == ACTIVITY_ERROR for a in activity.values()):
        return RingVerdict(Ring.IGNORE, "a member died: its death re-forms the ring")
    limit = collective_timeout / 2
    stuck = tuple(
        w for w, a in activity.items() if isinstance(a, Mapping) and not a["in_collective"] and a["idle_s"] > limit
    )
    if stuck:
        return RingVerdict(
            Ring.KILL,
            f"{', '.join(stuck)} made no collective call for over {limit:g} s while the others timed out",
            stuck,
        )
    if last_timeout_reset is not None and now - last_timeout_reset < 3 * collective_timeout:
        if not errors or any(is_timeout(e.error) for e in errors):
            return RingVerdict(
                Ring.FAIL,
                "the ring timed out twice in a row with every worker alive and inside a collective: the ranks' "
                "collectives do not match, most likely a deadlock in train_fn",
            )
        again = repeated_error(previous_errors, errors)
        if again is not None:
            return RingVerdict(
                Ring.FAIL,
                f"the ring failed with the same error in two generations in a row, every worker alive: "
                f"{_quoted(again)}; re-forming it would fail the same way",
            )
        first = sorted(errors, key=lambda e: (bool(_ECHO.search(e.error)), e.rank))[0]
        return RingVerdict(
            Ring.FAIL,
            f"the ring failed in two generations in a row with every worker alive, no collective timed out: "
            f"{_quoted(first)}",
        )
    return RingVerdict(Ring.REFORM, "every member is alive and inside a collective: the ring is re-formed")


BUSY_CPU_SHARE = 0.1
"""A thread using this share of a CPU is computing. A hung worker's threads (Ray's own, the
control threads waiting for the GIL) use under 2% together; a computing thread gets
far more, even on a node whose CPUs run five times as many threads as they have cores."""

_STATES = {"R": "running", "S": "sleeping", "D": "waiting on I/O", "T": "stopped", "t": "stopped", "Z": "a zombie"}
# a process in these states wants the machine, and gets too little of it: runnable on a loaded CPU (R), or in an
# uninterruptible disk wait (D). Under full CPU load a live worker's ping can be late while its share is low; only
# a process that sleeps (S: a deadlock), is stopped (T) or is a zombie uses no CPU because it is hung.
_WAITING_FOR_THE_MACHINE = frozenset({"R", "D"})


_STOPPED = frozenset({"T", "t", "Z"})


def judged_before_its_first_answer(sample: CpuSample | str) -> bool:
    """Whether a worker that never answered a ping is judged now, or left to its boot deadline.

    A process that has not answered yet is booting: it waits on Ray (its
    task's arrival, the function's object, a runtime env), on imports from
    disk, or on a CPU of a loaded node, and a boot sleeps most of that time
    with little CPU. A reading that shows it sleeping is no evidence of a
    hang, and killing it held whole runs back on loaded machines (every
    newcomer killed in turn, their nodes cooling down). Only a process that
    is stopped (SIGSTOP, a debugger) or a zombie is judged in a round; the
    rest is bounded by the boot deadline (`elastic_timeout`).
    """
    return isinstance(sample, CpuSample) and sample.state in _STOPPED


def judge_missed_ping(
    sample: CpuSample | str, *, silent_for: float, liveness_timeout: float, collective_timeout: float
) -> tuple[bool, str]:
    """Whether a member that did not answer a ping within `liveness_timeout` is busy (spare it) or hung (kill it).

    `sample` is its process's CPU use read on its node, or why no reading
    came back (within `liveness_timeout`: a node cut off counts as hung);
    `silent_for` how long it has not answered. A thread whose CPU time
    advances is computing: a long C call holding the GIL keeps the control
    thread from answering, and killing it would fail the same step forever.
    Such a member is spared until it has been silent for `collective_timeout`,
    its peers' own limit for waiting on it; then it is killed anyway. A
    process that uses no CPU (stopped, deadlocked, or sleeping in a C call
    that holds the GIL, which /proc cannot tell from a deadlock) is hung.
    Returns `(busy, reason)`.
    """
    if isinstance(sample, str):
        return False, (
            f"did not answer within liveness_timeout={liveness_timeout:g} s, and its CPU time could not be read: "
            f"{sample}"
        )
    share = sample.busiest_thread_s / sample.window_s if sample.window_s > 0 else 0.0
    state = f"process {_STATES.get(sample.state, 'state ' + sample.state)}"
    waiting = sample.state in _WAITING_FOR_THE_MACHINE
    if share < BUSY_CPU_SHARE and not waiting:
        return False, (
            f"did not answer within liveness_timeout={liveness_timeout:g} s and used no CPU "
            f"({share:.0%} of a CPU over {sample.window_s:.1f} s, {state}): hung"
        )
    if silent_for > collective_timeout:
        doing = f"waiting for the machine ({state})" if share < BUSY_CPU_SHARE else f"computing ({share:.0%} of a CPU)"
        return False, (
            f"has not answered for {silent_for:.0f} s, longer than collective_timeout={collective_timeout:g} s, "
            f"though it is {doing}"
        )
    if share < BUSY_CPU_SHARE:
        return True, (
            f"did not answer within liveness_timeout={liveness_timeout:g} s with little CPU ({share:.0%} over "
            f"{sample.window_s:.1f} s), but its {state}: waiting for the machine (a CPU or a disk), not hung; "
            f"spared up to collective_timeout={collective_timeout:g} s of silence"
        )
    return True, (
        f"did not answer within liveness_timeout={liveness_timeout:g} s but is computing ({share:.0%} of a CPU "
        f"over {sample.window_s:.1f} s): busy in a call that holds the GIL; spared while it computes, up to "
        f"collective_timeout={collective_timeout:g} s of silence"
    )


CRASH_LOOP_REPEATS = 3  # failures in a row that resume from the same commit make a crash loop


def decide_crash_loop(places: list[int], reasons: list[str]) -> tuple[bool, str]:
    """Whether the failures so far are one deterministic failure repeating.

    `places` holds, for each failure-driven reset in order, the commit the
    ranks resumed from; `reasons` what caused each. When the last
    `CRASH_LOOP_REPEATS` resets all resumed from the same commit, no commit
    was made between those failures: retrying would repeat them forever.
    """
    recent = places[-CRASH_LOOP_REPEATS:]
    if len(recent) < CRASH_LOOP_REPEATS or len(set(recent)) > 1:
        return False, "training made progress between failures"
    causes = "; ".join(dict.fromkeys(reasons[-CRASH_LOOP_REPEATS:]))
    return True, (
        f"the run failed {CRASH_LOOP_REPEATS} times in a row resuming from the same commit ({recent[-1]}) without "
        f"committing in between: the failure repeats at the same place, so retrying cannot help (causes: {causes})"
    )
