"""The core's part that watches the ranks' pace and lets stragglers go.

Every rank ships a summary of its pace (`runtime/pace.py`) with its metrics
every 1.5 s; the shell hands them over as `PacesReported`. Once the current
generation has trained whole (every member measured a full window), at
most once per interval, the pure policy (`stragglers.judge_stragglers`) is
asked whether members hold the ring back and whether the run would be
faster without them. The decision is per worker: a slow worker leaves
alone, and the other workers of its node stay; only when every worker of a
node is slow does the node leave whole. The leavers take the path a drained
node's workers take: marked leaving, left out of the next generation, which
every rank reaches at the same step through `HostsUpdatedInterrupt`: no
rollback, no step redone, the sampler's record of processed samples kept.
Their slots are held out of the plan (`stragglers.Bench`: one slot per
worker, or the whole node) while they cool down (`Probation`: the run's
`cooldown_range`, doubled by an eviction on the same host while on
probation), then offered again: a newcomer boots there and is admitted as
any other. A straggler kept (eviction off, no predicted gain,
`min_workers`, extra work in a steady pattern) is reported once per
generation: a warning and a `straggler_found` event.

Handling one summary costs O(1) at any world size (the members with a full
window are counted as they fill); the policy's pass over every window runs
once per interval. The windows are not part of the driver's snapshot: a
restarted driver refills them from the next summaries.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from ray_elastic.driver.core.roster import WorkerStatus
from ray_elastic.driver.core.stragglers import WINDOW, Probation, Straggler, StragglerVerdict, judge_stragglers
from ray_elastic.protocol import PACE_INTERVAL_S as INTERVAL_S
from ray_elastic.protocol import EventKind, PaceSummary

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ray_elastic.driver.core import messages as m
    from ray_elastic.driver.core.generations import Generations
    from ray_elastic.driver.core.run_record import RunRecord

logger = logging.getLogger(__name__)


class PaceWatch:
    """The members' pace summaries, the policy's verdicts, and the slots let go as stragglers'."""

    def __init__(self, record: RunRecord, generations: Generations) -> None:
        self.record = record
        self.generations = generations
        self.probation = Probation(*record.config.cooldown_range)
        self.comm: dict[int, float] = {}  # world size -> the ring's communication per step, measured healthy
        self._told: set[tuple[str, int]] = set()  # (worker, generation) reported as a straggler kept
        self._fresh()

    def _fresh(self) -> None:
        """The windows: refilled by the ranks' next summaries, never snapshotted."""
        self.paces: dict[str, deque[PaceSummary]] = {}
        self._judged_at: float | None = None
        self._waits: deque[float] = deque(maxlen=2000)  # the current generation's waits per step, every member's
        self._of = 0  # the generation `_waits` and `_full` are of
        self._full: set[str] = set()  # members whose window holds WINDOW intervals of that generation
        self._sums: dict[str, list[float]] = {}  # per worker: steps, compute and wait over its window, kept as it moves

    def __getstate__(self) -> dict[str, Any]:
        # at thousands of ranks the windows are most of the core's size (8192 ranks: ~80k summaries)
        kept = ("record", "generations", "probation", "comm", "_told")
        return {k: v for k, v in self.__dict__.items() if k in kept}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh()

    def on_paces(self, msg: m.PacesReported, now: float) -> None:
        self.release(now)
        worker_id = msg.worker_id
        kept = self.paces.get(worker_id)
        if kept is None:
            kept = self.paces[worker_id] = deque(maxlen=WINDOW)
            self._sums[worker_id] = [0.0, 0.0, 0.0]
        sums = self._sums[worker_id]
        for summary in msg.paces:
            if len(kept) == WINDOW:
                old = kept[0]
                sums[0] -= old.steps
                sums[1] -= old.compute_s
                sums[2] -= old.wait_s
            kept.append(summary)
            sums[0] += summary.steps
            sums[1] += summary.compute_s
            sums[2] += summary.wait_s
        gens = self.generations
        if gens.syncing or worker_id not in gens.plan:
            return
        if self._of != gens.generation:
            self._waits.clear()
            self._full.clear()
            self._of = gens.generation
        self._waits.extend(p.wait_per_step for p in msg.paces if p.generation == gens.generation and p.steps)
        if len(kept) == WINDOW and kept[0].generation == gens.generation:
            self._full.add(worker_id)
        if self._judged_at is not None and now - self._judged_at < INTERVAL_S:
            return  # once per interval is enough, and keeps the driver's loop flat at thousands of ranks
        if len(self._full) < len(gens.plan):
            return  # a member has not measured a whole window in this generation yet
        self._judged_at = now
        roster = self.record.roster
        if any(roster[w].status is not WorkerStatus.MEMBER for w in gens.plan):
            return  # a member is leaving or finished: the next generation is judged afresh
        config = self.record.config
        every = self._sums
        verdict = judge_stragglers(
            {w: self.paces[w] for w in gens.plan},
            pace={w: (every[w][1] / every[w][0], every[w][2] / every[w][0]) for w in gens.plan},
            generation=gens.generation,
            min_workers=config.min_workers,
            evict=config.evict_stragglers,
            healthy_comm=self._healthy_comm(len(gens.plan)),
            hosts={w: roster[w].host for w in gens.plan},
        )
        worker = verdict.worker
        if worker is None or verdict.verdict is Straggler.NONE:
            return
        if verdict.verdict is Straggler.EVICT and worker in self.record.evicted:
            pass  # let go already, and held over while it hands the state on: its slot is benched once
        elif verdict.verdict is Straggler.EVICT:
            self._evict(verdict, worker, now)
        elif (worker, gens.generation) not in self._told:
            self._told.add((worker, gens.generation))
            detail = f"straggler: {_who(verdict, roster[worker].host)}: {verdict.reason}"
            logger.warning(detail)
            ev = gens.event(EventKind.STRAGGLER_FOUND, detail, now)
            ev.reset_duration = 0.0
            self.record.events.append(ev)

    def _healthy_comm(self, size: int) -> float | None:
        """The ring's communication per step at this world size, as low as it was measured (None: not yet).

        The lowest wait per step any member measured over an interval of
        this generation (each an average over the interval's steps): in a
        healthy ring the last rank to arrive waits for the collective
        alone, and a straggler only raises the waits, so the intervals
        before a slowdown hold the low one. (A percentile reads high once
        slow intervals outnumber the healthy ones.) Kept per world size
        across generations, so that a host re-admitted while still slow is
        judged against the ring as it was without it.
        """
        if len(self._waits) >= size:
            low = min(self._waits)
            self.comm[size] = min(self.comm.get(size, low), low)
        return self.comm.get(size)

    def _evict(self, verdict: StragglerVerdict, worker: str, now: float) -> None:
        """Let the verdict's workers go gracefully with the next generation; hold their slots while they cool down."""
        record = self.record
        host = record.roster[worker].host
        seconds, note = self.probation.evicted(host, now)
        if verdict.node is not None:
            record.benched.hold_node(host, now + seconds)
            held = f"the node is {note}"
        else:
            record.benched.hold_slot(host, now + seconds)
            held = f"its slot on node {host[:8]} is {note}; the node's other workers stay"
        for worker_id in verdict.workers:
            record.roster.move(record.roster[worker_id], WorkerStatus.LEAVING, "let go as a straggler")
            record.evicted.add(worker_id)
        detail = f"straggler evicted: {_who(verdict, host)}: {verdict.reason}; {held}"
        logger.warning(detail)
        self.generations.later(self.generations.event(EventKind.STRAGGLER_EVICTED, detail, now))

    def release(self, now: float) -> None:
        """Slots and nodes whose cool-down ended are offered again (on probation)."""
        if self.record.benched:
            for host in self.record.benched.release(now):
                logger.info("node %s's straggler cool-down ended: offered again, on probation", host[:8])

    def prune(self, now: float, forgotten: Iterable[str]) -> None:
        """Forget the paces of the workers the roster just forgot, old reports, and probations that ended."""
        for worker_id in forgotten:
            if worker_id in self.paces:
                del self.paces[worker_id], self._sums[worker_id]
        generation = self.generations.generation
        self._told = {t for t in self._told if t[1] == generation}
        self.probation.forget(now)


def _who(verdict: StragglerVerdict, host: str) -> str:
    """The workers a verdict names, and where."""
    if verdict.node is not None:
        return f"{', '.join(verdict.workers)} on node {host[:8]} (every worker of the node)"
    return f"{verdict.worker} on node {host[:8]}"
