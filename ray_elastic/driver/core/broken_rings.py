"""Broken rings: members that stop answering, and a ring that breaks with every member alive.

A member that misses its pings is judged on its CPU time
(`policies.judge_missed_ping`): one computing in a long call that holds the
GIL is spared up to `collective_timeout`, a silent one is killed as hung. A
rank whose ring breaks while no death explains it makes the driver ask
every member what it is doing (`QueryActivity`); the answers, with the
errors the ranks told (`ResetRequested`), tell a rank stuck in user code
(killed) from a failure to re-form once (`REFORM`) or one that repeats with
nothing changed (the run fails, quoting the error and the rank that raised
it; a deadlock only when the collectives timed out):
`policies.judge_ring_failure`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.policies import (
    Ring,
    RingError,
    judge_missed_ping,
    judge_ring_failure,
    judged_before_its_first_answer,
)
from ray_elastic.driver.core.roster import ALIVE, IN_RING
from ray_elastic.protocol import EventKind

if TYPE_CHECKING:
    from ray_elastic.driver.core.failures import Failures
    from ray_elastic.driver.core.finishing import Finishing
    from ray_elastic.driver.core.generations import Generations
    from ray_elastic.driver.core.run_record import RunRecord

logger = logging.getLogger(__name__)
_FINISH_WINDOW = 4  # generations before the newest broken one whose ring errors a late return still checks


class BrokenRings:
    """The liveness verdicts, and the activity question asked after a ring broke with everyone alive."""

    def __init__(self, record: RunRecord, generations: Generations, finishing: Finishing, failures: Failures) -> None:
        self.record = record
        self.generations = generations
        self.finishing = finishing
        self.failures = failures
        self._last_timeout_reset: float | None = None  # when a ring last broke with everyone alive
        self._newest_round = float("-inf")  # when the newest liveness round taken was sent
        self._querying: int | None = None  # the generation whose members' activity is being asked
        self._query: m.QueryActivity | None = None  # that question, asked again by a restarted driver
        # what each rank raised when its ring broke, for the current and the previous broken generation
        self._errors: dict[int, dict[str, RingError]] = {}
        # the same, kept through membership changes for `on_finished`: a rank returning from the generation it
        # trained in last must find its peers' errors of that generation though a drain has replaced it since
        self._told_by: dict[int, dict[str, RingError]] = {}

    def membership_changed(self) -> None:
        """A generation absorbed a real change: a later timeout is a new story, not a repeat."""
        self._last_timeout_reset = None
        self._errors = {}

    def query_again(self) -> list[m.Action]:
        """The activity question, if one was out (for a restarted driver)."""
        return [self._query] if self._querying is not None and self._query is not None else []

    def _told(self, generation: int) -> list[RingError]:
        return sorted(self._errors.get(generation, {}).values())

    def on_pings(self, msg: m.PingResults, now: float) -> None:
        """Kill the members that stopped answering, unless their CPU time shows them computing (`judge_missed_ping`)."""
        roster, config = self.record.roster, self.record.config
        if msg.sent_at < self._newest_round:
            return  # an older round than one already taken (delivered late, or twice): the newer one tells more
        self._newest_round = msg.sent_at
        # only an answer from a worker not yet heard from, or silent, changes its record
        for worker_id in roster.unsettled.intersection(msg.answered):
            rec = roster.get(worker_id)
            if rec is not None:
                if rec.spared:
                    busy_s = now - (rec.silent_since or now)
                    logger.info("worker %s answers again after %.1f s busy", worker_id, busy_s)
                rec.heard()
        for worker_id in sorted(msg.timed_out):
            rec = roster.get(worker_id)
            sample = msg.samples.get(worker_id, "no reading was taken")
            # a process still booting is bounded by the boot deadline instead, unless a reading of it shows it
            # stopped before its first answer (`judged_before_its_first_answer`)
            if rec is None or rec.status not in ALIVE or not (rec.answered or judged_before_its_first_answer(sample)):
                continue
            rec.went_silent(msg.sent_at)
            silent_since = msg.sent_at if rec.silent_since is None else rec.silent_since
            busy, reason = judge_missed_ping(
                sample,
                silent_for=now - silent_since,
                liveness_timeout=config.liveness_timeout,
                collective_timeout=config.collective_timeout,
            )
            if busy:
                if not rec.spared:
                    logger.warning("worker %s on node %s %s", worker_id, rec.host[:8], reason)
                rec.spare()
                continue
            logger.warning("worker %s on node %s %s; killing it", worker_id, rec.host[:8], reason)
            self.failures.fence(rec, reason, now)

    def on_finished(self, trained_in: int | None = None) -> None:
        """A worker returned from train_fn: a member whose ring broke in this generation, or in the one the worker
        trained in last (`trained_in`), cannot finish with it.

        Its word may have come before the return (and the members' answers
        too), when nothing said yet that the ranks finish unevenly; it sends
        no second one, so the uneven finish is told now, not never. The ring
        it told broken may even have been formed again since, with the
        returned ranks in it: they never join that ring, and its members
        would wait for them until `collective_timeout`.
        """
        if self.record.phase.is_final or not self.finishing.active:
            return
        current = self.generations.generation
        if self.failures.fail_if_raised(current):
            return
        roster = self.record.roster
        told = sorted(self._told_by.get(current, {}).values())
        if trained_in is not None and trained_in != current:
            told += sorted(self._told_by.get(trained_in, {}).values())
        for error in told:
            rec = roster.get(error.worker_id)
            if rec is not None and rec.status in IN_RING:
                self.finishing.fail_uneven(error.worker_id, error.error)
                return

    def on_reset_requested(self, msg: m.ResetRequested) -> None:
        """A rank's ring broke. Usually a death explains it; else ask every member what it is doing."""
        gens, roster = self.generations, self.record.roster
        if msg.generation != gens.generation or msg.worker_id not in gens.plan:
            return  # a word about a ring already re-formed, or dropped whole (a durable restart empties the plan)
        if self.failures.raised_in(msg.generation):
            return  # a rank's train_fn raised and left the ring: that re-forms it, nobody is to blame
        rank = gens.plan.rank(msg.worker_id)
        if rank is not None:
            told = self._errors.setdefault(msg.generation, {})
            told.setdefault(msg.worker_id, RingError(rank, msg.worker_id, msg.reason))
            for old in [g for g in self._errors if g < msg.generation - 1]:
                del self._errors[old]
            self._told_by.setdefault(msg.generation, {}).setdefault(msg.worker_id, told[msg.worker_id])
            for old in [g for g in self._told_by if g < msg.generation - _FINISH_WINDOW]:
                del self._told_by[old]
        if self.finishing.active:
            self.finishing.fail_uneven(msg.worker_id, msg.reason)
            return
        if self._querying == msg.generation:
            return
        if any(roster[w].status not in ALIVE for w in gens.plan):
            return  # a death explains it, and its message re-forms the ring
        self._querying = msg.generation
        self._query = m.QueryActivity(msg.generation, tuple(gens.plan), msg.worker_id, msg.reason)
        self.record.act(self._query)

    def on_activity(self, msg: m.ActivityReport, now: float) -> None:
        """The members' answers about a broken ring: kill the stuck, re-form once, or fail a repeating timeout."""
        gens, config = self.generations, self.record.config
        if self._querying == msg.generation:
            self._querying = None
        if msg.generation != gens.generation or not gens.plan or self.failures.raised_in(msg.generation):
            return  # the ring was re-formed or dropped (a durable restart) meanwhile, or a raise re-forms it
        if self.finishing.active:
            # the ring broke as a rank returned from train_fn (its peers' error can beat its exit to us)
            self.finishing.fail_uneven(msg.worker_id, msg.reason)
            return
        verdict = judge_ring_failure(
            msg.activity,
            collective_timeout=config.collective_timeout,
            liveness_timeout=config.liveness_timeout,
            last_timeout_reset=self._last_timeout_reset,
            now=now,
            errors=self._told(msg.generation),
            previous_errors=self._told(msg.generation - 1),
        )
        if verdict.verdict is Ring.KILL:
            logger.warning("ring of generation %d broke: %s; killing them", msg.generation, verdict.reason)
            for worker_id in verdict.kill:
                rec = self.record.roster.get(worker_id)
                if rec is not None and rec.status in ALIVE:
                    self.failures.fence(rec, verdict.reason, now)
        elif verdict.verdict is Ring.FAIL:
            self.record.fail(
                f"{verdict.reason} (generations {gens.generation - 1} and {gens.generation}; last error, "
                f"worker {msg.worker_id}: {msg.reason})"
            )
        elif verdict.verdict is Ring.REFORM:
            self.failures.note_cause(f"worker {msg.worker_id}: {msg.reason}")
            self._last_timeout_reset = now
            gens.later(gens.event(EventKind.RESET_REQUESTED, f"worker {msg.worker_id}: {msg.reason}", now))
            gens.reform()
