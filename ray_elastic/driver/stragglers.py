"""Stragglers: which rank, if any, holds the whole ring back, and whether letting it go makes the run faster.

In synchronous data parallelism every step waits for the slowest rank, so
one slow node (a noisy neighbour, thermal throttling, a failing disk under
the data loader) drags the whole run down to its pace. Each rank measures
its own compute per step and its wait in the step's gradient collectives
(`runtime/pace.py`) and ships one summary per 1.5 s interval with its
metrics. `judge_stragglers` reads them and returns a `StragglerVerdict`,
the decision and its reason first, as the driver's other policies do
(`policies.py`); the driver carries out an eviction as a graceful leave (the
path a drained node's workers take: no rollback, no step redone), and
`Probation` cools the host down before it is offered again.

The window, and why. A rank is a straggler when its compute per step is at
least `THRESHOLD` (1.5x) the median of the others' in at least `SLOW_IN` (8)
of its last `WINDOW` (10) intervals, i.e. over about 15 s of training, of
which 12 s must be slow:

- a garbage-collection pause (tens of ms, rarely a second) or a checkpoint
  write (rank 0 pickles and writes in the background: a few seconds of a
  shared CPU at worst) slows one or two intervals, three at most; it would
  have to last 12 s to count. Comparing each interval with the others' pace
  over the whole window keeps one bad interval of theirs from moving the bar;
- a node that turned slow for good is found 12-15 s after it turned, and
  the ring is re-formed about a second later, well within the 30 s after
  which the run should be back at the healthy pace (issue 39);
- a shorter window (say 5 s) would take a long checkpoint write on a slow
  disk for a slow node; a longer one (a minute) would leave the run at a
  third of its speed for that minute, every time.

Intervals are counted per rank (at least one step each), not in seconds: a
run whose steps take several seconds is judged on 10 steps per rank. Only
the current generation's intervals count: a reset starts the window again,
so after an eviction the new world is judged on its own pace.

The threshold, and the prediction. 1.5x is the issue's figure and leaves
room for the ranks' normal differences (rank 0 reports, commits and writes
checkpoints; data loading varies), which are far below it here. Being slower
is not enough: the run must be predicted faster without the rank. With n
ranks, the time to process one global batch (n ranks' batches) is the
straggler's step, `c_s + w_s`: its compute and its own wait (the last rank
to arrive waits only for the collective itself). With n-1 ranks at the
others' pace it is `n/(n-1) * (c_o + comm)`, `c_o` the others' median
compute and `comm` the communication of a healthy ring: a rank starved of
CPU is slow inside the collectives too (each rank reduces and forwards its
share of a ring allreduce), so its own wait overstates what the others
would wait without it. The driver measures `comm` while no rank straggles
(`healthy_comm`: the lowest of the generation's waits, from before the
slowdown); without such a measure the straggler's own wait stands in,
which can keep a straggler but never evicts one wrongly. A rank is let go
only when n-1 ranks are predicted `MIN_GAIN` (10%) faster: an eviction
costs one reset and the re-admission another, about a second each, repaid
within ten seconds at that gain. In a world of two, a rank 1.5x slower is
kept: alone, the other would take 2x as long per global batch.
"""

from __future__ import annotations

import bisect
import enum
import statistics
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from ray_elastic.assignment import Cooldown
from ray_elastic.runtime.pace import PaceSummary

THRESHOLD = 1.5  # compute per step against the others' median
WINDOW = 10  # intervals per rank (1.5 s each: about 15 s of training)
SLOW_IN = 8  # of them at or over the threshold: slow for 12 s, not a pause
MIN_GAIN = 0.1  # predicted speed-up an eviction must bring


class Straggler(enum.Enum):
    NONE = "none"  # no rank is persistently slower (or the window is not full yet)
    KEPT = "kept"  # a straggler, kept: the run is not predicted faster without it, or min_workers
    REPORTED = "reported"  # a straggler the run would be faster without, but eviction is off
    EVICT = "evict"  # let it go, gracefully


class StragglerVerdict(NamedTuple):
    verdict: Straggler
    reason: str  # the measured paces and the prediction: logged, and the event's detail
    worker: str | None = None
    speedup: float | None = None  # predicted: time per global batch with it / without it


def window_pace(summaries: Sequence[PaceSummary]) -> tuple[float, float]:
    """Compute and wait seconds per step over `summaries`."""
    steps = sum(s.steps for s in summaries)
    return sum(s.compute_s for s in summaries) / steps, sum(s.wait_s for s in summaries) / steps


def judge_stragglers(
    paces: Mapping[str, Sequence[PaceSummary]],
    *,
    generation: int,
    min_workers: int,
    evict: bool = True,
    healthy_comm: float | None = None,
) -> StragglerVerdict:
    """Whether one of the current generation's members is a straggler, and what to do with it.

    `paces` holds every member's summaries, oldest first (older
    generations' are ignored); `min_workers` is never gone below; `evict`
    False keeps every straggler and only reports it. `healthy_comm` is the
    ring's communication per step measured while no rank straggled (None:
    not measured). At most one rank is named per call: the slowest of the
    persistent ones.
    """
    windows = {w: [s for s in ss if s.generation == generation and s.steps > 0][-WINDOW:] for w, ss in paces.items()}
    if len(windows) < 2:
        return StragglerVerdict(Straggler.NONE, "fewer than two ranks: nobody to compare with")
    short = {w: len(ss) for w, ss in windows.items() if len(ss) < WINDOW}
    if short:
        return StragglerVerdict(
            Straggler.NONE, f"the window is not full yet ({min(short.values())} of {WINDOW} intervals)"
        )
    pace = {w: window_pace(ss) for w, ss in windows.items()}
    ranked = sorted(p[0] for p in pace.values())
    candidates = []
    for w, ss in windows.items():
        others = _median_without(ranked, pace[w][0])
        slow = sum(1 for s in ss if s.compute_per_step >= THRESHOLD * others)
        if slow >= SLOW_IN:
            candidates.append((pace[w][0], w, others, slow))
    if not candidates:
        return StragglerVerdict(
            Straggler.NONE,
            f"no rank computes {THRESHOLD:g}x the others' median in {SLOW_IN} of its last {WINDOW} intervals",
        )
    _, worker, c_o, slow = max(candidates)
    n = len(windows)
    c_s = statistics.median(s.compute_per_step for s in windows[worker])
    w_s = pace[worker][1]
    comm, measured_when = w_s, "its own wait: the ring was not measured healthy in this generation"
    if healthy_comm is not None and healthy_comm < w_s:
        comm, measured_when = healthy_comm, "measured while no rank straggled"
    with_it = c_s + w_s
    without = n / (n - 1) * (c_o + comm)
    speedup = with_it / without
    others_wait = statistics.median(pace[o][1] for o in windows if o != worker)
    span = sum(s.end - s.start for s in windows[worker])
    measured = (
        f"{worker} computes {_ms(c_s)} per step, {c_s / c_o:.1f}x the others' median {_ms(c_o)}, in {slow} of its "
        f"last {WINDOW} intervals ({span:.0f} s); it waits {_ms(w_s)} per step in the gradient collectives, the "
        f"others {_ms(others_wait)} (for it); compute per step: "
        + ", ".join(f"{w} {_ms(pace[w][0])}" for w in sorted(pace))
    )
    predicted = (
        f"predicted per global batch: {n} workers {_ms(with_it)} ({_ms(c_s)} + {_ms(w_s)} waiting), "
        f"{n - 1} workers {_ms(without)} ({n}/{n - 1} x ({_ms(c_o)} + {_ms(comm)} communication, {measured_when})): "
        f"{speedup:.2f}x as fast without it"
    )
    reason = f"{measured}; {predicted}"
    if speedup < 1 + MIN_GAIN:
        why = "slower" if speedup < 1 else f"less than {MIN_GAIN:.0%} faster"
        return StragglerVerdict(Straggler.KEPT, f"{reason}; kept: {n - 1} workers would be {why}", worker, speedup)
    if n - 1 < min_workers:
        return StragglerVerdict(
            Straggler.KEPT,
            f"{reason}; kept: {n - 1} workers would be fewer than min_workers={min_workers}",
            worker,
            speedup,
        )
    if not evict:
        return StragglerVerdict(Straggler.REPORTED, f"{reason}; kept: eviction is off", worker, speedup)
    return StragglerVerdict(Straggler.EVICT, f"{reason}; it leaves gracefully", worker, speedup)


def _median_without(ranked: list[float], value: float) -> float:
    """The median of sorted `ranked` with one occurrence of `value` left out (O(log n): thousands of ranks)."""
    i = bisect.bisect_left(ranked, value)
    n = len(ranked) - 1

    def at(k: int) -> float:
        return ranked[k if k < i else k + 1]

    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


class Probation:
    """Hosts let go as stragglers: cooled down, offered again after it, on probation.

    The first eviction cools the host down for `min_s`; an eviction within
    `max_s` of being offered again doubles the previous cool-down (capped at
    `max_s`): the run's `cooldown_range`, as for a host whose workers
    failed, with a count of its own, so that a failure and a slow spell do
    not add up.
    """

    def __init__(self, min_s: float, max_s: float) -> None:
        self._cooldown = Cooldown(min_s, max_s)

    def evicted(self, host: str, now: float) -> tuple[float, str]:
        """Start the host's cool-down; its length, and the text that says so."""
        seconds = self._cooldown.record_failure(host, now)
        if seconds > self._cooldown.min_s:  # a second eviction within probation (the first lasts min_s)
            return seconds, f"evicted again while on probation: cooling down for {seconds:g} s (doubled)"
        return seconds, f"cooling down for {seconds:g} s, then offered again on probation"

    def cooling(self, now: float) -> set[str]:
        return self._cooldown.cooling(now)

    def forget(self, now: float) -> None:
        """Hosts that kept pace for `max_s` after their re-admission leave probation."""
        self._cooldown.forget(now)
