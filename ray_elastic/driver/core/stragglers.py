"""Stragglers: which rank, if any, holds the whole ring back, and whether letting it go makes the run faster.

In synchronous data parallelism every step waits for the slowest rank, so
one slow node (a noisy neighbour, thermal throttling, a failing disk under
the data loader) drags the whole run down to its pace. Each rank measures
its own compute per step and its wait in the step's gradient collectives
(`runtime/pace.py`) and ships one summary per 1.5 s interval with its
metrics. `judge_stragglers` reads them and returns a `StragglerVerdict`,
the decision and its reason first, as the driver's other policies do
(`policies.py`); the driver carries out an eviction as a graceful leave (the
path a drained node's workers take: no rollback, no step redone), `Bench`
holds the leaver's slot (or its whole node) out of the plan, and
`Probation` sets how long before it is offered again.

Per worker, not per node. With several workers per node, a slow worker is
let go alone; the verdict names a whole node only when every worker on it
is a straggler (the node itself is slow), and the prediction and
`min_workers` then count every worker that would leave. The framework's own
work on one rank (rank 0's copy of a commit for the checkpoint writer, its
wait for the previous write) is set aside by the rank's pace meter and
never reaches these summaries. A rank doing extra work of the user's every
N steps has a slow mean step but a median step at the others' pace: it is
kept, and reported, unless it holds the others under 1/`THRESHOLD` of
their healthy pace for the whole window.

The window, and why. A rank is a straggler when its compute per step is at
least `THRESHOLD` (1.5x) the median of the others' in at least `SLOW_IN` (8)
of its last `WINDOW` (10) intervals, i.e. over about 15 s of training, of
which 12 s must be slow:

- a garbage-collection pause (tens of ms, rarely a second) or the CPU a
  background checkpoint write takes (a few seconds of a shared CPU at worst)
  slows one or two intervals, three at most; it would have to last 12 s to
  count. Comparing each interval with the others' pace
  over the whole window keeps one bad interval of theirs from moving the bar;
- a node that turned slow for good is found 12-15 s after it turned, and
  the ring is re-formed about a second later, well within the 30 s after
  which the run should be back at the healthy pace;
- a shorter window (say 5 s) would take a long checkpoint write on a slow
  disk for a slow node; a longer one (a minute) would leave the run at a
  third of its speed for that minute, every time.

Intervals are counted per rank (at least one step each), not in seconds: a
run whose steps take several seconds is judged on 10 steps per rank. Only
the current generation's intervals count: a reset starts the window again,
so after an eviction the new world is judged on its own pace.

The threshold, and the prediction. 1.5x leaves room for the ranks' normal
differences (rank 0 reports; data loading varies), which stay far below
it, and still catches a node slowed by a third. Being slower
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
import heapq
import statistics
from typing import TYPE_CHECKING, NamedTuple

from ray_elastic.assignment import Cooldown

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ray_elastic.protocol import PaceSummary

THRESHOLD = 1.5  # compute per step against the others' median
WINDOW = 10  # intervals per rank (1.5 s each: about 15 s of training)
SLOW_IN = 8  # of them at or over the threshold: slow for 12 s, not a pause
MIN_GAIN = 0.1  # predicted speed-up an eviction must bring


class Straggler(enum.Enum):
    NONE = "none"  # no rank is persistently slower (or the window is not full yet)
    KEPT = "kept"  # a straggler, kept: no predicted gain, min_workers, or extra work in a steady pattern
    REPORTED = "reported"  # a straggler the run would be faster without, but eviction is off
    EVICT = "evict"  # let it go, gracefully


class StragglerVerdict(NamedTuple):
    verdict: Straggler
    reason: str  # the measured paces and the prediction: logged, and the event's detail
    worker: str | None = None  # the slowest straggler
    speedup: float | None = None  # predicted: time per global batch with them / without them
    workers: tuple[str, ...] = ()  # every worker the verdict is about: the straggler, or every worker of its node
    node: str | None = None  # set when the slowness is the node's: every worker on it is slow


def window_pace(summaries: Sequence[PaceSummary]) -> tuple[float, float]:
    """Compute and wait seconds per step over `summaries`."""
    steps = sum(s.steps for s in summaries)
    return sum(s.compute_s for s in summaries) / steps, sum(s.wait_s for s in summaries) / steps


def _typical(summary: PaceSummary) -> float:
    """The interval's median step compute (its mean where the meter did not say)."""
    return summary.compute_per_step if summary.typical_s is None else summary.typical_s


def judge_stragglers(
    paces: Mapping[str, Sequence[PaceSummary]],
    *,
    generation: int,
    min_workers: int,
    evict: bool = True,
    healthy_comm: float | None = None,
    hosts: Mapping[str, str] | None = None,
    pace: Mapping[str, tuple[float, float]] | None = None,
) -> StragglerVerdict:
    """Whether members of the current generation are stragglers, and what to do with them.

    `paces` holds every member's summaries, oldest first (older
    generations' are ignored); `hosts` maps each member to its node (None:
    one worker per node). `min_workers` is never gone below; `evict` False
    keeps every straggler and only reports it. `healthy_comm` is the ring's
    communication per step measured while no rank straggled (None: not
    measured). `pace`, when the caller keeps it as the windows move: each
    member's compute and wait per step over its window, whose `paces` then
    hold the current generation's full windows (checked otherwise).

    The decision is per worker: the slowest persistent straggler alone,
    unless every worker of its node is one, in which case the slowness is
    the node's and the verdict names all of them. The prediction and
    `min_workers` count every worker that would leave.
    """
    windows: Mapping[str, Sequence[PaceSummary]]
    if pace is None:
        windows = {
            w: [s for s in ss if s.generation == generation and s.steps > 0][-WINDOW:] for w, ss in paces.items()
        }
    else:
        windows = paces
    if len(windows) < 2:
        return StragglerVerdict(Straggler.NONE, "fewer than two ranks: nobody to compare with")
    if pace is None:
        short = {w: len(ss) for w, ss in windows.items() if len(ss) < WINDOW}
        if short:
            return StragglerVerdict(
                Straggler.NONE, f"the window is not full yet ({min(short.values())} of {WINDOW} intervals)"
            )
        pace = {w: window_pace(ss) for w, ss in windows.items()}
    ranked = sorted(p[0] for p in pace.values())
    # a rank slow in SLOW_IN of WINDOW intervals computes well over the median on the whole window (a ring steps
    # together, so its intervals hold about as many steps each): only those are looked at interval by interval
    bar = _PREFILTER * ranked[(len(ranked) - 2) // 2]  # the lowest the others' median can be, leaving any one out
    candidates = []
    for w, (compute, _) in pace.items():
        if compute < bar:
            continue
        others = _median_without(ranked, compute)
        slow = sum(1 for s in windows[w] if s.compute_per_step >= THRESHOLD * others)
        if slow >= SLOW_IN:
            candidates.append((compute, w, slow))
    if not candidates:
        return StragglerVerdict(
            Straggler.NONE,
            f"no rank computes {THRESHOLD:g}x the others' median in {SLOW_IN} of its last {WINDOW} intervals",
        )
    _, worker, slow = max(candidates)
    leaving: tuple[str, ...] = (worker,)
    node: str | None = None
    if hosts is not None:
        slow_ones = {w for _, w, _ in candidates}
        host = hosts.get(worker)
        on_host = tuple(sorted((w for w in windows if hosts.get(w) == host), key=lambda w: -pace[w][0]))
        if len(on_host) > 1 and all(w in slow_ones for w in on_host):
            leaving, node = on_host, host
    n, k = len(windows), len(leaving)
    staying = [w for w in windows if w not in leaving]
    c_o = statistics.median(pace[w][0] for w in staying)
    c_s = statistics.median(s.compute_per_step for s in windows[worker])
    w_s = pace[worker][1]
    comm, measured_when = w_s, "its own wait: the ring was not measured healthy in this generation"
    if healthy_comm is not None and healthy_comm < w_s:
        comm, measured_when = healthy_comm, "measured while no rank straggled"
    with_it = c_s + w_s
    without = n / (n - k) * (c_o + comm)
    speedup = with_it / without
    others_wait = statistics.median(pace[o][1] for o in staying)
    span = sum(s.end - s.start for s in windows[worker])
    who = worker if node is None else f"every worker of node {node[:8]} ({', '.join(leaving)}); the slowest, {worker},"
    measured = (
        f"{who} computes {_ms(c_s)} per step, {c_s / c_o:.1f}x the others' median {_ms(c_o)}, in {slow} of its "
        f"last {WINDOW} intervals ({span:.0f} s); it waits {_ms(w_s)} per step in the gradient collectives, the "
        f"others {_ms(others_wait)} (for it); compute per step: "
        + ", ".join(f"{w} {_ms(pace[w][0])}" for w in heapq.nsmallest(_LISTED, pace))
        + (f" and {len(pace) - _LISTED} more" if len(pace) > _LISTED else "")
    )
    predicted = (
        f"predicted per global batch: {n} workers {_ms(with_it)} ({_ms(c_s)} + {_ms(w_s)} waiting), "
        f"{n - k} workers {_ms(without)} ({n}/{n - k} x ({_ms(c_o)} + {_ms(comm)} communication, {measured_when})): "
        f"{speedup:.2f}x as fast without {'it' if k == 1 else 'them'}"
    )
    reason = f"{measured}; {predicted}"

    def verdict(kind: Straggler, why: str) -> StragglerVerdict:
        return StragglerVerdict(kind, f"{reason}; {why}", worker, speedup, leaving, node)

    if speedup < 1 + MIN_GAIN:
        return verdict(Straggler.KEPT, f"kept: {n - k} workers would be {'slower' if speedup < 1 else _less()}")
    if n - k < min_workers:
        return verdict(Straggler.KEPT, f"kept: {n - k} workers would be fewer than min_workers={min_workers}")
    pattern = _steady_pattern(windows, worker, staying, c_o + comm)
    if pattern is not None:
        return verdict(Straggler.KEPT, f"kept: {pattern}")
    if not evict:
        return verdict(Straggler.REPORTED, "kept: eviction is off")
    return verdict(Straggler.EVICT, "it leaves gracefully" if k == 1 else "they leave gracefully")


_PREFILTER = 1.1  # of the median compute per step: below it no rank is slow in SLOW_IN intervals
_LISTED = 16  # ranks whose compute the reason lists (thousands would drown the event)


def _less() -> str:
    return f"less than {MIN_GAIN:.0%} faster"


def _steady_pattern(
    windows: Mapping[str, Sequence[PaceSummary]], worker: str, staying: Sequence[str], healthy_step: float
) -> str | None:
    """Why `worker`'s slowness is extra work in a steady pattern to be kept, or None to judge it as slow.

    A rank that is slow at every step (a slow node, a throttled CPU) has a
    slow median step. A rank whose extra work comes every N steps (an
    evaluation, a log written on one rank) has a median step at the
    others' pace, and only its mean is high. Such a rank is kept, and
    reported, unless it holds the others under 1/THRESHOLD of their pace
    in every interval of the window: each interval, their median step
    (compute and waiting) at least THRESHOLD x the healthy step
    (`healthy_step`: their compute plus the ring's communication).
    """
    typical_others = statistics.median(_typical(s) for o in staying for s in windows[o])
    mine = [_typical(s) for s in windows[worker]]
    if sum(1 for t in mine if t >= THRESHOLD * typical_others) >= SLOW_IN:
        return None  # slow at most steps: a slow worker, not a pattern
    held = [
        statistics.median((s.compute_s + s.wait_s) / s.steps for s in (windows[o][i] for o in staying)) / healthy_step
        for i in range(WINDOW)
    ]
    if min(held) >= THRESHOLD:
        return None  # the pattern keeps the others under 1/1.5 of their pace for the whole window
    return (
        f"its median step computes {_ms(statistics.median(mine))}, at the others' pace ({_ms(typical_others)}): "
        f"the extra work comes in a steady pattern, and it holds the others at {1 / max(held):.2f} to "
        f"{1 / min(held):.2f} of their pace, not under 1/{THRESHOLD:g} for the whole window"
    )


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
    """Hosts whose stragglers were let go: cooled down, offered again after it, on probation.

    The first eviction on a host cools it (a slot of it, or the whole
    node) down for `min_s`; an eviction within `max_s` of being offered
    again doubles the previous cool-down (capped at `max_s`): the run's
    `cooldown_range`, as for a host whose workers failed, with a count of
    its own, so that a failure and a slow spell do not add up.
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


class Bench:
    """Slots held out of the plan while their stragglers cool down: one per worker let go, or a whole node.

    A worker let go alone frees one slot of its host, and that slot stays
    empty for its cool-down, so no newcomer refills it at once: Ray gives a
    newcomer on that host the resources the leaver freed (its GPU, its
    share of the node), which may be what made it slow. The host's other
    slots keep their workers. A node whose workers were all slow is held
    out whole, whatever it offers. `version` changes with every slot held
    or given back, so the core re-plans then.
    """

    def __init__(self) -> None:
        self._slots: dict[str, list[float]] = {}  # host -> when each held slot is given back
        self._nodes: dict[str, float] = {}  # host -> when the whole node is given back
        self.version = 0

    def hold_slot(self, host: str, until: float) -> None:
        self._slots.setdefault(host, []).append(until)
        self.version += 1

    def hold_node(self, host: str, until: float) -> None:
        self._nodes[host] = max(until, self._nodes.get(host, until))
        self.version += 1

    def usable(self, host: str, offered: int) -> int:
        """The slots of `offered` that may be planned with on `host`."""
        if host in self._nodes:
            return 0
        return max(0, offered - len(self._slots.get(host, ())))

    def release(self, now: float) -> list[str]:
        """Give back what cooled down; the hosts that got something back."""
        back = [h for h, until in self._nodes.items() if until <= now]
        for host in back:
            del self._nodes[host]
        for host, ends in list(self._slots.items()):
            kept = [t for t in ends if t > now]
            if len(kept) < len(ends):
                back.append(host)
                if kept:
                    self._slots[host] = kept
                else:
                    del self._slots[host]
        if back:
            self.version += 1
        return back

    def __bool__(self) -> bool:
        return bool(self._slots or self._nodes)

    def __contains__(self, host: str) -> bool:
        return host in self._nodes or host in self._slots
