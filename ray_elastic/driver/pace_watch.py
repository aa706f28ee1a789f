"""The core's part that watches the ranks' pace and lets a straggler go.

Every rank ships a summary of its pace (`runtime/pace.py`) with its metrics
every 1.5 s; the shell hands them over as `PacesReported`. Once the current
generation has trained whole (every member measured), at most once per
interval, the pure policy (`stragglers.judge_stragglers`) is asked whether
a member holds the ring back and whether the run would be faster without
it. An eviction takes the path a drained node's workers take: the host is
benched (`RunRecord.benched`), so `Scaling` leaves its worker out of the
next generation, which every rank reaches at the same step through
`HostsUpdatedInterrupt`: no rollback, no step redone, the sampler's record
of processed samples kept. The host cools down (`Probation`: the run's
`cooldown_range`, doubled by an eviction while on probation) and is then
offered again: a newcomer boots there and is admitted as any other. A
straggler kept (eviction off, no predicted gain, `min_workers`) is reported
once per generation: a warning and a `straggler_found` event.
"""

from __future__ import annotations

import logging
from collections import deque

from ray_elastic.driver import messages as m
from ray_elastic.driver.generations import Generations
from ray_elastic.driver.record import RunRecord
from ray_elastic.driver.roster import WorkerStatus
from ray_elastic.driver.stragglers import WINDOW, Probation, Straggler, judge_stragglers
from ray_elastic.protocol import EventKind
from ray_elastic.runtime.pace import INTERVAL_S, PaceSummary

logger = logging.getLogger(__name__)


class PaceWatch:
    """The members' pace summaries, the policy's verdicts, and the hosts let go as stragglers."""

    def __init__(self, record: RunRecord, generations: Generations) -> None:
        self.record = record
        self.generations = generations
        self.probation = Probation(*record.config.cooldown_range)
        self.paces: dict[str, deque[PaceSummary]] = {}
        self._judged_at: float | None = None
        self._waits: deque[float] = deque(maxlen=2000)  # the current generation's waits per step, every member's
        self._waits_of = 0  # their generation
        self.comm: dict[int, float] = {}  # world size -> the ring's communication per step, measured healthy
        self._told: set[tuple[str, int]] = set()  # (worker, generation) reported as a straggler kept

    def on_paces(self, msg: m.PacesReported, now: float) -> None:
        self.release(now)
        kept = self.paces.setdefault(msg.worker_id, deque(maxlen=WINDOW))
        kept.extend(msg.paces)
        gens, roster = self.generations, self.record.roster
        if gens.syncing or not gens.plan or msg.worker_id not in gens.plan:
            return
        if self._waits_of != gens.generation:
            self._waits.clear()
            self._waits_of = gens.generation
        self._waits.extend(p.wait_per_step for p in msg.paces if p.generation == gens.generation and p.steps)
        if self._judged_at is not None and now - self._judged_at < INTERVAL_S:
            return  # once per interval is enough, and keeps the driver's loop flat at thousands of ranks
        if any(roster[w].status is not WorkerStatus.MEMBER for w in gens.plan):
            return  # a member is leaving or finished: the next generation is judged afresh
        if not all(self._full(w) for w in gens.plan):
            return  # a member has not measured a whole window in this generation yet
        self._judged_at = now
        config = self.record.config
        verdict = judge_stragglers(
            {w: self.paces.get(w, ()) for w in gens.plan},
            generation=gens.generation,
            min_workers=config.min_workers,
            evict=config.evict_stragglers,
            healthy_comm=self._healthy_comm(len(gens.plan)),
        )
        if verdict.verdict is Straggler.EVICT:
            self._evict(verdict.worker, verdict.reason, now)
        elif verdict.verdict is not Straggler.NONE and (verdict.worker, gens.generation) not in self._told:
            self._told.add((verdict.worker, gens.generation))
            rec = roster[verdict.worker]
            detail = f"straggler: {verdict.worker} on node {rec.host[:8]}: {verdict.reason}"
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
        before a slowdown hold the low one. (A percentile was tried first:
        with the slowdown a few seconds into the generation, as in
        `bench/straggler.py`, the slow intervals outnumbered the healthy ones
        and it read 17.7 ms for a ring that steps in under 10.) Kept per
        world size across generations, so that a host re-admitted while
        still slow is judged against the ring as it was without it.
        """
        if len(self._waits) >= size:
            low = min(self._waits)
            self.comm[size] = min(self.comm.get(size, low), low)
        return self.comm.get(size)

    def _full(self, worker_id: str) -> bool:
        kept = self.paces.get(worker_id)
        return kept is not None and len(kept) == WINDOW and kept[0].generation == self.generations.generation

    def _evict(self, worker_id: str, reason: str, now: float) -> None:
        """Bench its host: the next generation leaves it out, gracefully; the host cools down."""
        rec = self.record.roster[worker_id]
        seconds, note = self.probation.evicted(rec.host, now)
        self.record.benched[rec.host] = now + seconds
        self.record.evicted.add(worker_id)
        detail = f"straggler evicted: {worker_id} on node {rec.host[:8]}: {reason}; the node is {note}"
        logger.warning(detail)
        self.generations.later(self.generations.event(EventKind.STRAGGLER_EVICTED, detail, now))

    def release(self, now: float) -> None:
        """Hosts whose cool-down ended are offered again (on probation)."""
        for host, until in list(self.record.benched.items()):
            if until <= now:
                del self.record.benched[host]
                logger.info("node %s's straggler cool-down ended: offered again, on probation", host[:8])

    def prune(self, now: float) -> None:
        """Forget the paces of workers no longer on record, old reports, and probations that ended."""
        workers = self.record.roster.workers
        for worker_id in [w for w in self.paces if w not in workers]:
            del self.paces[worker_id]
        generation = self.generations.generation
        self._told = {t for t in self._told if t[1] == generation}
        self.probation.forget(now)
