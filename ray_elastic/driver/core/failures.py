"""Failures: deaths, fencing, cool-down, a `train_fn` raising, crash loops, and every member lost.

A worker that dies, or that the driver kills as failed, is fenced at once:
its death is recorded when it is decided, nothing it sends afterwards
counts, and the other members of its ring are told to abandon it
(`Abandon`) before any new generation exists, so none waits out
`collective_timeout` on a neighbour that is gone. Its host cools down
(`assignment.Cooldown`), unless its node is gone. A failure that keeps
resuming from the same commit is a crash loop and fails the run
(`policies.decide_crash_loop`). When no member is left to hold the state,
only a durable checkpoint lets the run go on. Broken rings with every
member alive are judged in `broken_rings.py`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ray_elastic.assignment import Cooldown
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.policies import CRASH_LOOP_REPEATS, decide_crash_loop, decide_user_error
from ray_elastic.driver.core.roster import ALIVE, IN_RING, SPARES, WorkerRecord, WorkerStatus
from ray_elastic.protocol import EventKind, UserError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ray_elastic.assignment import Plan
    from ray_elastic.driver.core.finishing import Finishing
    from ray_elastic.driver.core.generations import Generations
    from ray_elastic.driver.core.run_record import RunRecord

logger = logging.getLogger(__name__)

_FAILURE_KINDS = frozenset({EventKind.WORKER_FAILED, EventKind.RESET_REQUESTED, EventKind.RESTARTED})
_RAISED = "train_fn raised in worker"  # how a reset after a raise is told: bounded by max_failures, no crash loop


class Failures:
    """What a failure costs the run: who is fenced, which host cools down, and whether the run can go on."""

    def __init__(self, record: RunRecord, generations: Generations, finishing: Finishing) -> None:
        self.record = record
        self.generations = generations
        self.finishing = finishing
        self.cooldown = Cooldown(*record.config.cooldown_range)
        self._user_failures = 0
        # generation -> the retry it spent (one per attempt; at most max_failures + 1 entries before the run fails)
        self._attempts_failed: dict[int, str] = {}
        self._reformed_for: int | None = None  # the generation a raise re-forms
        self._raised: dict[int, str] = {}  # generation -> its first raise, with its traceback
        self._causes: list[str] = []  # what broke the members since the last failure-driven reset synced
        self.failure_places: list[int] = []  # per failure-driven reset: the commit training resumed from
        self._failure_reasons: list[str] = []
        self.last_abandon: m.Abandon | None = None  # the newest generation declared dead to its live members
        # what `last_abandon` names, when it was a plan's members less a few: so it pickles as that plan (whose
        # bytes the snapshot holds anyway) and the few, not as thousands of names
        self._abandoned: tuple[Plan, frozenset[str]] | None = None
        self._checkpoint_lookup: int | None = None  # the generation whose holders were lost, while a lookup is out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._abandoned is not None and self.last_abandon is not None:
            state["last_abandon"] = self.last_abandon._replace(worker_ids=())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._abandoned is not None and self.last_abandon is not None:
            plan, skip = self._abandoned
            self.last_abandon = self.last_abandon._replace(worker_ids=tuple(plan.ids_except(skip)))

    def note_cause(self, cause: str) -> None:
        """What broke the ring, named if the failures repeat (a crash loop) or every member is lost."""
        self._causes.append(cause)

    # ---- train_fn raising ------------------------------------------------------------------
    def _count_attempt(self, generation: int, retryable: bool) -> tuple[bool, str]:
        """One failure per attempt (generation), as Ray Train counts: a second rank's raise in it is free."""
        if retryable and generation in self._attempts_failed:
            return True, self._attempts_failed[generation]
        retry, reason = decide_user_error(self._user_failures, self.record.config.max_failures, retryable)
        if retry:
            self._user_failures += 1
            self._attempts_failed[generation] = reason  # kept: a word delivered twice must not count twice
        return retry, reason

    def _describe_raise(self, worker_id: str, host: str, error: str, retryable: bool = True) -> str:
        rank = self.generations.plan.rank(worker_id)
        where = f"rank {rank} " if rank is not None else ""
        said = _RAISED if retryable else "worker"
        return f"{said} {worker_id} ({where}on node {host[:8]}): {error}"

    def raised_in(self, generation: int) -> bool:
        """Whether a rank's `train_fn` raised in `generation`: its ring's break is explained, nobody is to blame."""
        return generation in self._attempts_failed

    def fail_if_raised(self, generation: int) -> bool:
        """A rank returned from train_fn where another raised: no re-entry together; the run fails with the raise."""
        raised = self._raised.get(generation)
        if raised is not None:
            self.record.fail(
                raised.replace(
                    "\n", "; a rank returned from train_fn meanwhile, so the ranks cannot re-enter together\n", 1
                )
            )
        return raised is not None

    def on_raised(self, msg: m.TrainFnRaised, now: float) -> None:
        """A rank raised and stays: the run fails, or (within `max_failures`) every rank re-enters from the commit.

        The raising rank has left its ring and waits for the next
        generation; the others are told to leave theirs now (`Abandon`), and
        the ring re-forms with the same members: nobody is killed, no
        newcomer is needed, the failure is counted once for its generation.
        """
        record, gens = self.record, self.generations
        rec = record.roster.get(msg.worker_id)
        if rec is None or rec.status not in ALIVE or record.phase.is_final:
            return
        text = self._describe_raise(rec.worker_id, rec.host, msg.error)
        if self.finishing.active:  # a rank has returned: the others cannot train on without it
            record.fail(f"{text}\n{msg.traceback}".rstrip())
            return
        retry, reason = self._count_attempt(msg.generation, True)
        if not retry:
            spent = f" ({reason})" if record.config.max_failures else ""
            record.fail(f"{text}{spent}\n{msg.traceback}".rstrip())
            return
        logger.warning("%s (%s); every rank re-enters from the last commit\n%s", text, reason, msg.traceback)
        self._raised.setdefault(msg.generation, f"{text}\n{msg.traceback}")
        for old in [g for g in self._raised if g < msg.generation - 1]:
            del self._raised[old]
        if msg.generation != gens.generation or self._reformed_for == msg.generation:
            return  # counted; its generation is already over, or already re-forming
        self._reformed_for = msg.generation
        others = tuple(w for w in gens.plan if w != rec.worker_id and record.roster[w].status in ALIVE)
        if others:
            self.last_abandon = m.Abandon(gens.generation, others, f"{text} ({reason})")
            self._abandoned = None
            record.act(self.last_abandon)
        self.note_cause(text)
        detail = f"{text} ({reason}): every rank re-enters train_fn from the last commit"
        gens.later(gens.event(EventKind.RESET_REQUESTED, detail, now))
        gens.reform()

    def on_user_error(self, msg: m.WorkerExited, now: float) -> None:
        """`train_fn` returned by raising: the run fails with its traceback, unless `max_failures` retries it.

        The exception left `train_fn` itself (outside `@elastic.run`), so
        the worker cannot re-enter in place: it is replaced, as after a death.
        """
        rec, outcome = self.record.roster.get(msg.worker_id), msg.outcome
        if rec is None or not isinstance(outcome, UserError):
            return
        text = self._describe_raise(rec.worker_id, rec.host, outcome.error, outcome.retryable)
        retry, reason = self._count_attempt(self.generations.generation, outcome.retryable)
        if not retry:
            self.record.fail(f"{text}\n{outcome.traceback}".rstrip())
            return
        logger.warning("%s (%s)\n%s", text, reason, outcome.traceback)
        self.record.act(m.Kill(rec.worker_id))
        self.on_died(rec.worker_id, f"{outcome.error} ({reason})", True, now, what=f"raised {outcome.error} ({reason})")

    # ---- deaths ------------------------------------------------------------------------
    def fence(self, rec: WorkerRecord, why: str, now: float) -> None:
        """Kill a worker judged failed (hung, stuck, not booted in time): it is dead from this moment.

        Its death is recorded now, not when Ray reports it: its `run()` may
        have returned just before the kill (no death would follow), and until
        then it must neither be admitted to a generation nor speak for one.
        """
        self.record.act(m.Kill(rec.worker_id, failed=True))
        self.on_died(rec.worker_id, why, True, now, what="was killed", because=why)

    def on_died(
        self, worker_id: str, reason: str, node_alive: bool, now: float, what: str = "died", because: str = ""
    ) -> None:
        """A worker is gone: release it, cool its node down (unless the node went too), and say so in an event.

        `because`, for a worker the driver killed, is the driver's reason: the
        event says why a process that looked alive to the user was ended.
        """
        record, gens = self.record, self.generations
        rec = record.roster.get(worker_id)
        if rec is None or rec.status not in ALIVE:
            return
        was_member = rec.status in IN_RING
        was_spare = rec.status in SPARES
        record.roster.fenced.add(worker_id)
        self._abandon(rec, what)
        record.roster.move(rec, WorkerStatus.GONE, f"{what}: {reason}")
        record.act(m.Release(worker_id))
        if node_alive:
            note = f"; node cooling down for {self.cooldown.record_failure(rec.host, now):g} s"
        else:
            record.hosts.pop(rec.host, None)
            note = "; its node is gone"
        rank = gens.plan.rank(worker_id)
        where = f"rank {rank}" if rank is not None else "newcomer"
        logger.warning("worker %s (%s) on node %s died: %s%s", worker_id, where, rec.host[:8], reason, note)
        if rank == 0 and self.finishing.rank0_lost(rec, reason):
            return
        why = f": {because}" if because else ""
        if was_member:
            self._causes.append(f"worker {worker_id} ({where}): {reason}")
            detail = f"worker {worker_id} ({where}) on node {rec.host[:8]} {what}{why}{note}"
            gens.later(gens.event(EventKind.WORKER_FAILED, detail, now))
        else:
            # a newcomer (or a hot spare) lost before it joined: a fault, but nobody trained with it, so no reset
            spare = "hot spare " if was_spare else ""
            detail = f"{spare}worker {worker_id} on node {rec.host[:8]} {what} before joining{why}{note}"
            ev = gens.event(EventKind.NEWCOMER_FAILED, detail, now)
            ev.reset_duration = 0.0
            record.events.append(ev)
        self.finishing.end_if_done()

    def _abandon(self, lost: WorkerRecord, what: str) -> None:
        """A member of the current ring is lost: tell the others at once, before any new generation exists.

        A rank blocked in a collective waits only on its ring neighbours, which
        may not include the lost one: without this word it would wait out
        `collective_timeout`. Once per generation.
        """
        gens, roster = self.generations, self.record.roster
        rank = gens.plan.rank(lost.worker_id)
        if rank is None or (self.last_abandon is not None and self.last_abandon.generation >= gens.generation):
            return
        ended = roster.ids(WorkerStatus.GONE, WorkerStatus.FINISHED)  # a plan's members are never starting
        skip = frozenset({lost.worker_id, *ended})
        others = tuple(gens.plan.ids_except(skip))
        reason = f"worker {lost.worker_id} (rank {rank}) of generation {gens.generation} {what}"
        self.last_abandon = m.Abandon(gens.generation, others, reason)
        self._abandoned = (gens.plan, skip)
        if others:
            self.record.act(self.last_abandon)

    def check_boot_deadlines(self, now: float) -> None:
        """A worker not ready within `elastic_timeout` of its start is killed as failed."""
        timeout = self.record.config.elastic_timeout
        for rec in self.record.roster.live(WorkerStatus.STARTING, WorkerStatus.SPARE_BOOTING):
            if now - rec.started_at > timeout:
                logger.warning("worker %s did not become ready within %g s; killing it", rec.worker_id, timeout)
                self.fence(rec, f"it did not become ready within elastic_timeout={timeout:g} s", now)

    # ---- failures that repeat ---------------------------------------------------------
    def check_crash_loop(self, generation: int, place: int | None) -> None:
        """A generation that a failure made has synced: note where it resumed, and stop a repeating failure."""
        failures = [e for e in self.record.events.of_generation(generation) if e.kind in _FAILURE_KINDS]
        if place is None or not failures or all(e.detail.startswith(_RAISED) for e in failures):
            return  # train_fn raising again is bounded by max_failures, the user's own bound
        self.failure_places.append(place)
        causes, self._causes = self._causes, []
        self._failure_reasons.append(causes[0] if causes else failures[0].detail)
        del self.failure_places[:-CRASH_LOOP_REPEATS], self._failure_reasons[:-CRASH_LOOP_REPEATS]
        loop, reason = decide_crash_loop(self.failure_places, self._failure_reasons)
        if loop:
            self.record.fail(reason)

    # ---- every member lost -------------------------------------------------------------
    def all_lost(self) -> None:
        """Nobody holds the trained state: go on only from a durable checkpoint (`CheckpointFound` answers)."""
        if self.record.config.checkpoint_dir is None:
            self._fail_all_lost("configure checkpoint_dir to resume from a durable checkpoint")
        elif self._checkpoint_lookup is None:
            self._checkpoint_lookup = self.generations.generation
            self.record.act(m.LookForCheckpoint())

    def on_checkpoint_found(self, msg: m.CheckpointFound, now: float) -> None:
        """The lookup's answer, unless it is stale: a holder came back, or a generation was published, since."""
        gens, where = self.generations, self.record.config.checkpoint_dir
        asked, self._checkpoint_lookup = self._checkpoint_lookup, None
        if asked is None or asked != gens.generation or gens.holder_alive():
            logger.info("ignored the durable checkpoint lookup's answer: a worker holding the state is back")
            return
        if msg.error is not None:
            self._fail_all_lost(
                f"the durable checkpoint in {where} could not be looked for within "
                f"elastic_timeout={self.record.config.elastic_timeout:g} s: {msg.error}"
            )
            return
        if not msg.exists:
            self._fail_all_lost("no durable checkpoint was written yet")
            return
        detail = f"{_lost(gens)}; the workers left resume from the durable checkpoint in {where}"
        gens.later(gens.event(EventKind.RESTARTED, detail, now))
        gens.restart_from_checkpoint(now)

    def _fail_all_lost(self, why: str) -> None:
        gens = self.generations
        causes = "".join(f"\n  {cause}" for cause in self._causes)
        self.record.fail(
            f"{_lost(gens)}; no survivor holds the training state, so the run cannot continue "
            f"({why}){': ' + causes if causes else ''}"
        )

    def on_resumed(self, msg: m.WorkerResumed, now: float) -> None:
        """Rank 0 loaded the durable checkpoint before its first sync: an event says which, and how old."""
        meta: Mapping[str, Any] = msg.meta
        wall = now + self.record.wall_offset
        age = wall - meta.get("written_at", wall)
        ev = self.generations.event(
            EventKind.RESUMED,
            f"worker {msg.worker_id} (rank 0) loaded the durable checkpoint of commit {meta.get('commit')} "
            f"(written {age:.1f} s ago at world size {meta.get('world_size')})"
            + (f": {meta['reason']}" if meta.get("reason") else ""),
            now,
        )
        ev.reset_duration = 0.0
        self.record.events.append(ev)

    # ---- a restarted driver -------------------------------------------------------------
    def abandon_again(self) -> list[m.Action]:
        """The newest word that a ring lost a member, to its members still alive: they may still block in it."""
        if self.last_abandon is None:
            return []
        alive = tuple(w for w in self.last_abandon.worker_ids if w in self.record.roster.alive_ids())
        return [self.last_abandon._replace(worker_ids=alive)] if alive else []

    def look_again(self) -> list[m.Action]:
        """The checkpoint lookup, if one was out."""
        return [m.LookForCheckpoint()] if self._checkpoint_lookup is not None else []


def _lost(gens: Generations) -> str:
    """Who was lost, for the event or the failure: the holders of the trained state, by name."""
    lost = gens.lost_holders()
    if len(lost) == len(gens.plan):
        return f"all {len(lost)} workers of generation {gens.generation} were lost ({', '.join(lost)})"
    return f"every worker holding the trained state was lost ({', '.join(lost)})"
