"""The driver's pure core: the run's membership as data, messages in, actions out.

`DriverCore.handle(messages, now)` applies a batch of messages (see
`messages.py`) and returns the actions the shell must carry out: spawn or
kill workers, publish a generation, query the members' activity, look for a
durable checkpoint, ask the autoscaler for resources. It never waits and
never calls Ray, so every path (a death during a reset, deaths together, a
newcomer dying before admission, `max_failures`, a deadlock, each deadline)
is tested by replaying message scripts in milliseconds (`tests/test_driver_core.py`).

What the core stores is what cannot be derived: the workers and their
status, the hosts, the current plan, the events, the cool-downs. The state
(`DriverState`), the number of resets and whether training is finishing are
derived from those. A batch's messages are applied in order and the ring is
re-planned once at the end, so deaths that arrive together join one reset.
The judgement calls are the pure functions of `policies.py`; who goes where
is `assignment.py`'s.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray_elastic.assignment import Cooldown, LiveWorker, WorkerSlot, assign_ranks, plan_scaling
from ray_elastic.config import RunConfig
from ray_elastic.driver import messages as m
from ray_elastic.driver.event_log import EventLog
from ray_elastic.driver.policies import (
    CRASH_LOOP_REPEATS,
    PublishVerdict,
    Ring,
    decide_crash_loop,
    decide_publish,
    decide_user_error,
    judge_missed_ping,
    judge_ring_failure,
)
from ray_elastic.events import Event
from ray_elastic.protocol import CoordinatorLost, DriverState, EventKind, Finished, UserError

logger = logging.getLogger(__name__)


class WorkerStatus(enum.Enum):
    STARTING = "starting"  # placement group, actor start, train_fn set-up
    READY = "ready"  # entered the run loop, waits to be admitted
    MEMBER = "member"  # part of the current generation
    LEAVING = "leaving"  # left out of the next generation, exits at its next check
    FINISHED = "finished"  # train_fn returned
    GONE = "gone"  # died, removed or killed


ALIVE = frozenset({WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.MEMBER, WorkerStatus.LEAVING})
_FAILURE_KINDS = frozenset({EventKind.WORKER_FAILED, EventKind.RESET_REQUESTED, EventKind.RESTARTED})


@dataclass
class WorkerRecord:
    worker_id: str
    host: str
    seq: int  # spawn order: smaller is older
    status: WorkerStatus
    started_at: float  # monotonic
    answered: bool = False  # has answered a ping or said it is ready: its process is up
    silent_since: float | None = None  # when the pings it has not answered since began (monotonic)
    spared: bool = False  # silent but computing: spared by the liveness check


class DriverCore:
    """The membership of one run. Not thread-safe: one loop drives it."""

    def __init__(self, config: RunConfig, wall_offset: float = 0.0, started_at: float = 0.0) -> None:
        """`wall_offset` turns the shell's monotonic `now` into wall-clock event times; `started_at` is monotonic."""
        self.config = config
        self.wall_offset = wall_offset
        self.started_at = started_at
        self.generation = 0
        self.plan: dict[str, WorkerSlot] = {}
        self.workers: dict[str, WorkerRecord] = {}
        self.hosts: dict[str, int] = {}
        self.draining: dict[str, float] = {}  # node -> wall-clock deadline (0: none); no worker may stay or start there
        self._missing_once: set[str] = set()  # hosts the last poll did not offer, kept for one more poll
        self._holding: str | None = None  # the withdrawn member kept to hand the trained state over
        self.host_first_seen: dict[str, float] = {}
        self.cooldown = Cooldown(*config.cooldown_range)
        self.events = EventLog()
        self.failure: str | None = None
        self.return_value: Any = None
        self._returned = False  # rank 0's train_fn returned its value: the run may end DONE
        self.checkpoint_error: str | None = None  # rank 0 finished but its last durable checkpoint was not written
        self._final: DriverState | None = None
        self._waiting_since: float | None = started_at
        self._unbound: list[Event] = []  # changes not yet absorbed by a generation
        # hosts_added events and the newcomers each announces: bound to the generation that admits one of them
        self._booting: list[tuple[Event, frozenset[str]]] = []
        self._syncing: set[str] = set()  # members of the newest generation still syncing
        self._seq = 0
        self._user_failures = 0
        self._last_timeout_reset: float | None = None  # when a ring last broke with everyone alive
        self._querying: int | None = None  # the generation whose members' activity is being asked
        self._query: m.QueryActivity | None = None  # that question, asked again by a restarted driver
        self._checkpoint_lookup = False  # a LookForCheckpoint is out
        self._force = False  # re-form the ring at the end of this batch even with the same members
        self._autoscale_requested = 0
        self._synced_commits: int | None = None  # the newest generation's commits, as its ranks synced
        self._failure_places: list[int] = []  # per failure-driven reset: the commit training resumed from
        self._failure_reasons: list[str] = []
        self._causes: list[str] = []  # what broke the members since the last failure-driven reset synced
        self._last_abandon: m.Abandon | None = None  # the newest generation declared dead to its live members
        # workers declared dead and still on record; one no longer on record (pruned) is just as void
        self.fenced: set[str] = set()
        self._actions: list[m.Action] = []

    # ---- derived state -------------------------------------------------------
    @property
    def state(self) -> DriverState:
        if self._final is not None:
            return self._final
        if self._waiting_since is not None:
            return DriverState.WAITING
        if self.generation > 1 and self._syncing:
            return DriverState.RESETTING
        return DriverState.RUNNING

    @property
    def resets(self) -> int:
        return max(0, self.generation - 1)

    @property
    def finishing(self) -> bool:
        """A worker's train_fn returned: the run ends once the other members end too."""
        return any(r.status is WorkerStatus.FINISHED for r in self.workers.values())

    def live(self, *statuses: WorkerStatus) -> list[WorkerRecord]:
        return [r for r in self.workers.values() if r.status in statuses]

    def alive_ids(self) -> list[str]:
        return [r.worker_id for r in self.workers.values() if r.status in ALIVE]

    def is_void(self, worker_id: str) -> bool:
        """Whether nothing `worker_id` sends counts: declared dead, or no longer on record."""
        return worker_id in self.fenced or worker_id not in self.workers

    # ---- a restarted driver -----------------------------------------------------
    def restarted(self, now: float, why: str) -> list[m.Action]:
        """This core came back from a snapshot in a restarted driver: the actions that may have been lost.

        The snapshot is written before a batch's actions are carried out, so
        the dead driver may have carried out some, all or none of the last
        batch's. What is asked again is safe to ask twice: the word that a
        ring lost a member (the newest one given, even for the generation
        before the current: its members may still block in it), the current
        generation to the KV actor (kept if it has it), the members'
        activity if a question was out, a checkpoint lookup if one was out,
        and the autoscaler's share. Spawns and kills are the shell's to
        reconcile with what exists (`DriverActor._reattach`): a worker killed
        as failed is already dead to the core, so it is not kept.
        """
        ev = self._event(EventKind.DRIVER_RESTARTED, f"the run's driver actor restarted ({why})", now)
        ev.reset_duration = 0.0
        self.events.append(ev)
        actions: list[m.Action] = []
        if self._last_abandon is not None:
            alive = tuple(w for w in self._last_abandon.worker_ids if w in self.alive_ids())
            if alive:
                actions.append(self._last_abandon._replace(worker_ids=alive))
        if self.generation:
            actions.append(m.RestoreKV(self.generation, dict(self.plan)))
        if self._querying is not None and self._query is not None:
            actions.append(self._query)
        if self._checkpoint_lookup:
            actions.append(m.LookForCheckpoint())
        if self._autoscale_requested:
            actions.append(m.RequestResources(self._autoscale_requested))
        return actions

    # ---- the one entry point -------------------------------------------------
    def handle(self, messages: Iterable[m.Message], now: float) -> list[m.Action]:
        """Apply `messages` in order, re-plan once, and return the actions to carry out."""
        for message in messages:
            if self._final is not None:
                break
            self._apply(message, now)
        if self._final is None:
            self._reconcile(now)
            self._maybe_publish(now)
            self._prune(now)
        actions, self._actions = self._actions, []
        return actions

    def _prune(self, now: float) -> None:
        """Forget what no decision needs any more, so a run with churn keeps the driver's size flat.

        A worker that is gone leaves the record once no generation, sync,
        boot announcement or hand-over names it (a late word from it is void
        all the same, `is_void`); a host leaves once it is neither offered
        nor hosting a worker on record; a cool-down, once it is forgotten.
        """
        named = set(self.plan) | self._syncing | {w for _, newcomers in self._booting for w in newcomers}
        for worker_id in [w for w, r in self.workers.items() if r.status is WorkerStatus.GONE and w not in named]:
            del self.workers[worker_id]
            self.fenced.discard(worker_id)
        if self._holding is not None and self._holding not in self.workers:
            self._holding = None
        in_use = {r.host for r in self.workers.values()}
        for host in [h for h in self.host_first_seen if h not in self.hosts and h not in in_use]:
            del self.host_first_seen[host]
        self.cooldown.forget(now)

    def _apply(self, msg: m.Message, now: float) -> None:
        sender = getattr(msg, "worker_id", None)
        if sender is not None and self.is_void(sender):
            # declared dead (killed as hung, or cut off and healed): its death is recorded, its word is void
            logger.info("ignored %s from worker %s, declared dead", type(msg).__name__, sender)
            return
        if isinstance(msg, m.HostsDiscovered):
            self._update_hosts(msg.hosts, now)
        elif isinstance(msg, m.NodesDraining):
            for node in set(msg.deadlines) - set(self.draining):
                deadline = msg.deadlines[node]
                left = f"{deadline - (now + self.wall_offset):.0f} s" if deadline else "no deadline"
                logger.warning("node %s is draining (%s): its workers leave at their next check", node[:8], left)
            self.draining = dict(msg.deadlines)
        elif isinstance(msg, m.WorkerReady):
            rec = self.workers.get(msg.worker_id)
            if rec is not None and rec.status is WorkerStatus.STARTING:
                rec.status = WorkerStatus.READY
                rec.answered = True  # its process is up: from now on the liveness check applies
        elif isinstance(msg, m.WorkerExited):
            self._on_exit(msg, now)
        elif isinstance(msg, m.WorkerDied):
            self._on_died(msg.worker_id, msg.reason, msg.node_alive, now)
        elif isinstance(msg, m.WorkerStartFailed):
            rec = self.workers.get(msg.worker_id)
            where = f" on node {rec.host[:8]}" if rec is not None else ""
            self.fail(f"Ray could not start worker {msg.worker_id}{where}: {msg.reason}")
        elif isinstance(msg, m.WorkerSynced):
            self._on_synced(msg)
        elif isinstance(msg, m.WorkerResumed):
            self._on_resumed(msg, now)
        elif isinstance(msg, m.ResetRequested):
            self._on_reset_requested(msg)
        elif isinstance(msg, m.ActivityReport):
            self._on_activity(msg, now)
        elif isinstance(msg, m.PingResults):
            self._on_pings(msg, now)
        elif isinstance(msg, m.CheckpointFound):
            self._on_checkpoint_found(msg, now)
        elif isinstance(msg, m.Tick):
            self._check_deadlines(now)
        elif isinstance(msg, m.PublishFailed):
            self.fail(f"the rendezvous (KV) actor did not take generation {msg.generation}: {msg.reason}")
        elif isinstance(msg, m.KVRestarted):
            self._on_kv_restarted(msg, now)
        elif isinstance(msg, m.KVLost):
            self.fail(f"the run's rendezvous (KV) actor died ({msg.reason}); workers cannot form rings")
        elif isinstance(msg, (m.DiscoveryFailed, m.Stop)):
            self.fail(msg.reason)
        else:
            raise TypeError(f"the driver core got an unknown message {msg!r}")

    def _update_hosts(self, offered: Mapping[str, int], now: float) -> None:
        """Take discovery's view; a host missing from one poll only is kept until the next (a blip is absorbed)."""
        for host in offered:
            self.host_first_seen.setdefault(host, now)
        missing = {h: n for h, n in self.hosts.items() if h not in offered and h not in self._missing_once}
        if missing:
            logger.info("discovery no longer offers %s; kept until the next poll confirms it", sorted(missing))
        self._missing_once = set(missing)
        self.hosts = {**missing, **offered}

    def fail(self, reason: str) -> None:
        if self._final is None:
            logger.error("run failed: %s", reason)
            self.failure = reason
            self._final = DriverState.FAILED

    def _done(self) -> None:
        if self._final is None:
            self._final = DriverState.DONE

    # ---- scaling -------------------------------------------------------------
    def _reconcile(self, now: float) -> None:
        """Bring the workers in line with the hosts: start newcomers, let leavers go."""
        if self.finishing:
            return
        staying = self.live(WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.MEMBER) + self._pending_leavers()
        decision = plan_scaling(
            [LiveWorker(r.worker_id, r.host, r.seq) for r in staying],
            self._usable_hosts(staying),
            self.host_first_seen,
            self.cooldown.cooling(now),
            self.config.max_workers,
        )
        remove = set(decision.remove)
        held = self._hold_over(remove)
        for rec in staying:
            if rec.worker_id in remove:
                if rec.status in (WorkerStatus.MEMBER, WorkerStatus.LEAVING):
                    rec.status = WorkerStatus.LEAVING  # leaves gracefully with the next generation
                else:
                    self._kill(rec)
            elif rec.status is WorkerStatus.LEAVING:
                logger.info("worker %s stays: its host is offered again before it left", rec.worker_id)
                rec.status = WorkerStatus.MEMBER
        add = dict(decision.add)
        if held is not None:
            # the held-over worker counts toward max_workers: one newcomer fewer
            world = len(staying) - len(remove) + sum(add.values())
            for host in reversed(list(add)):
                while world > self.config.max_workers and add[host]:
                    add[host] -= 1
                    world -= 1
        added = [self._spawn(host, now) for host, count in add.items() for _ in range(count)]
        if added and self.generation > 0:
            event = self._event(EventKind.HOSTS_ADDED, f"{len(added)} new worker(s)", now)
            self._booting.append((event, frozenset(added)))
        self._request_autoscale()

    def _usable_hosts(self, staying: list[WorkerRecord]) -> dict[str, int]:
        """Slots to plan with: none on a draining node; on a host kept for the blip grace, only its workers'."""
        usable = {}
        for host, slots in self.hosts.items():
            if host in self.draining:
                continue
            if host in self._missing_once:  # it may be gone for good: keep its workers, start none there
                slots = min(slots, sum(r.host == host for r in staying))
            usable[host] = slots
        return usable

    def _pending_leavers(self) -> list[WorkerRecord]:
        """Members withdrawn by discovery whose leaving no generation has carried out yet."""
        return [self.workers[w] for w in self.plan if self.workers[w].status is WorkerStatus.LEAVING]

    def _hold_over(self, remove: set[str]) -> str | None:
        """Keep one state holder among the members `remove` would take away, if no staying member holds the state.

        A member holds the trained state once it synced in the current
        generation. When discovery withdraws every holder at once (a blip, a
        whole pool replaced), the oldest of them stays until a generation
        with others has synced, so the state is handed over, never dropped.
        """
        members = [
            self.workers[w] for w in self.plan if self.workers[w].status in (WorkerStatus.MEMBER, WorkerStatus.LEAVING)
        ]
        removed = [r for r in members if r.worker_id in remove]
        if not removed or any(r.worker_id not in remove and r.worker_id not in self._syncing for r in members):
            return None
        keep = min(removed, key=lambda r: r.seq)
        remove.discard(keep.worker_id)
        if self._holding == keep.worker_id:
            return keep.worker_id
        self._holding = keep.worker_id
        logger.warning(
            "discovery withdrew every worker holding the trained state; worker %s on node %s stays until "
            "the others received it",
            keep.worker_id,
            keep.host[:8],
        )
        return keep.worker_id

    def _request_autoscale(self) -> None:
        """Ask Ray's autoscaler for the slots still missing up to max_workers."""
        wanted = self.config.max_workers if sum(self.hosts.values()) < self.config.max_workers else 0
        if wanted != self._autoscale_requested:
            self._autoscale_requested = wanted
            self._actions.append(m.RequestResources(wanted))

    def _spawn(self, host: str, now: float) -> str:
        self._seq += 1
        worker_id = f"w{self._seq}"
        self.workers[worker_id] = WorkerRecord(worker_id, host, self._seq, WorkerStatus.STARTING, now)
        self._actions.append(m.Spawn(worker_id, host))
        logger.info("starting worker %s on node %s", worker_id, host[:8])
        return worker_id

    def _kill(self, rec: WorkerRecord) -> None:
        """Stop a worker that is not needed (left out, or the run is finishing)."""
        self._actions.append(m.Kill(rec.worker_id))
        rec.status = WorkerStatus.GONE

    def _fence(self, rec: WorkerRecord, why: str, now: float) -> None:
        """Kill a worker judged failed (hung, stuck, not booted in time): it is dead from this moment.

        Its death is recorded now, not when Ray reports it: its `run()` may
        have returned just before the kill (no death would follow), and until
        then it must neither be admitted to a generation nor speak for one.
        """
        self._actions.append(m.Kill(rec.worker_id, failed=True))
        self._on_died(rec.worker_id, why, True, now, what="was killed")

    def _abandon(self, lost: WorkerRecord, what: str) -> None:
        """A member of the current ring is lost: tell the others at once, before any new generation exists.

        A rank blocked in a collective waits only on its ring neighbours, which
        may not include the lost one: without this word it would wait out
        `collective_timeout`. Once per generation.
        """
        slot = self.plan.get(lost.worker_id)
        if slot is None or (self._last_abandon is not None and self._last_abandon.generation >= self.generation):
            return
        others = tuple(w for w in self.plan if w != lost.worker_id and self.workers[w].status in ALIVE)
        reason = f"worker {lost.worker_id} (rank {slot.rank}) of generation {self.generation} {what}"
        self._last_abandon = m.Abandon(self.generation, others, reason)
        if others:
            self._actions.append(self._last_abandon)

    def _check_deadlines(self, now: float) -> None:
        timeout = self.config.elastic_timeout
        if self._waiting_since is not None and now - self._waiting_since > timeout:
            ready = len(self.live(WorkerStatus.READY, WorkerStatus.MEMBER))
            self.fail(
                f"min_workers={self.config.min_workers} not reached within elastic_timeout={timeout:g} s "
                f"(ready workers: {ready}; slots offered: {sum(self.hosts.values())}; "
                f"hosts cooling down: {len(self.cooldown.cooling(now))})"
            )
            return
        for rec in self.live(WorkerStatus.STARTING):
            if now - rec.started_at > timeout:
                logger.warning("worker %s did not become ready within %g s; killing it", rec.worker_id, timeout)
                self._fence(rec, f"it did not become ready within elastic_timeout={timeout:g} s", now)

    # ---- workers ending ----------------------------------------------------------
    def _on_exit(self, msg: m.WorkerExited, now: float) -> None:
        rec = self.workers.get(msg.worker_id)
        if rec is None:
            return
        outcome = msg.outcome
        if isinstance(outcome, CoordinatorLost):
            self.fail(outcome.error)
            return
        if isinstance(outcome, UserError):
            slot = self.plan.get(rec.worker_id)
            where = f"rank {slot.rank} " if slot is not None else ""
            said = "train_fn raised in worker" if outcome.retryable else "worker"
            text = f"{said} {rec.worker_id} ({where}on node {rec.host[:8]}): {outcome.error}"
            retry, reason = decide_user_error(self._user_failures, self.config.max_failures, outcome.retryable)
            if not retry:
                self.fail(f"{text}\n{outcome.traceback}".rstrip())
                return
            # the user asked for retries (flaky hardware): handle it as this worker's failure
            self._user_failures += 1
            logger.warning("%s (%s)\n%s", text, reason, outcome.traceback)
            self._actions.append(m.Kill(rec.worker_id))
            self._on_died(
                rec.worker_id, f"{outcome.error} ({reason})", True, now, what=f"raised {outcome.error} ({reason})"
            )
            return
        finished = isinstance(outcome, Finished)
        rec.status = WorkerStatus.FINISHED if finished else WorkerStatus.GONE
        self._actions.append(m.Kill(rec.worker_id))
        if finished:
            if outcome.rank == 0:
                self.return_value = outcome.value
                self.checkpoint_error = outcome.checkpoint_error
                self._returned = True
            for other in self.live(WorkerStatus.STARTING, WorkerStatus.READY):
                self._kill(other)
        if self.finishing and not self.live(WorkerStatus.MEMBER, WorkerStatus.LEAVING):
            self._done()

    def _on_died(self, worker_id: str, reason: str, node_alive: bool, now: float, what: str = "died") -> None:
        rec = self.workers.get(worker_id)
        if rec is None or rec.status not in ALIVE:
            return
        was_member = rec.status in (WorkerStatus.MEMBER, WorkerStatus.LEAVING)
        self.fenced.add(worker_id)
        self._abandon(rec, what)
        rec.status = WorkerStatus.GONE
        self._actions.append(m.Release(worker_id))
        if node_alive:
            note = f"; node cooling down for {self.cooldown.record_failure(rec.host, now):g} s"
        else:
            self.hosts.pop(rec.host, None)
            note = "; its node is gone"
        slot = self.plan.get(worker_id)
        where = f"rank {slot.rank}" if slot is not None else "newcomer"
        logger.warning("worker %s (%s) on node %s died: %s%s", worker_id, where, rec.host[:8], reason, note)
        if self.finishing and slot is not None and slot.rank == 0 and not self._returned:
            self._fail_result_lost(rec, reason)
            return
        if was_member:
            self._causes.append(f"worker {worker_id} ({where}): {reason}")
            detail = f"worker {worker_id} ({where}) on node {rec.host[:8]} {what}{note}"
            self._unbound.append(self._event(EventKind.WORKER_FAILED, detail, now))
        else:
            # a newcomer lost before it joined: a fault, but nobody trained with it, so no reset
            detail = f"worker {worker_id} on node {rec.host[:8]} {what} before joining{note}"
            ev = self._event(EventKind.NEWCOMER_FAILED, detail, now)
            ev.reset_duration = 0.0
            self.events.append(ev)
        if self.finishing and not self.live(WorkerStatus.MEMBER, WorkerStatus.LEAVING):
            self._done()

    # ---- liveness and broken rings -----------------------------------------------
    def _on_pings(self, msg: m.PingResults, now: float) -> None:
        """Kill the members that stopped answering, unless their CPU time shows them computing (`judge_missed_ping`)."""
        for worker_id in msg.answered:
            rec = self.workers.get(worker_id)
            if rec is not None:
                rec.answered = True
                if rec.spared:
                    logger.info("worker %s answers again after %.1f s busy", worker_id, now - rec.silent_since)
                rec.silent_since, rec.spared = None, False
        for worker_id in sorted(msg.timed_out):
            rec = self.workers.get(worker_id)
            # a process still starting (runtime env, imports) is bounded by the boot deadline instead
            if rec is None or rec.status not in ALIVE or not rec.answered:
                continue
            if rec.silent_since is None:
                rec.silent_since = msg.sent_at
            busy, reason = judge_missed_ping(
                msg.samples.get(worker_id, "no reading was taken"),
                silent_for=now - rec.silent_since,
                liveness_timeout=self.config.liveness_timeout,
                collective_timeout=self.config.collective_timeout,
            )
            if busy:
                if not rec.spared:
                    logger.warning("worker %s on node %s %s", worker_id, rec.host[:8], reason)
                rec.spared = True
                continue
            logger.warning("worker %s on node %s %s; killing it", worker_id, rec.host[:8], reason)
            self._fence(rec, reason, now)

    def _on_reset_requested(self, msg: m.ResetRequested) -> None:
        """A rank's ring broke. Usually a death explains it; else ask every member what it is doing."""
        if msg.generation != self.generation:
            return  # a word about a ring already re-formed
        if self.finishing:
            self._fail_uneven_finish(msg)
            return
        if self._querying == msg.generation:
            return
        if any(self.workers[w].status not in ALIVE for w in self.plan):
            return  # a death explains it, and its message re-forms the ring
        self._querying = msg.generation
        self._query = m.QueryActivity(msg.generation, tuple(self.plan), msg.worker_id, msg.reason)
        self._actions.append(self._query)

    def _fail_result_lost(self, rank0: WorkerRecord, reason: str) -> None:
        """Rank 0 was lost after a peer returned: the run's result (rank 0's value) is gone, so it cannot succeed."""
        done = ", ".join(
            f"rank {self.plan[w].rank} ({w})" for w in self.plan if self.workers[w].status is WorkerStatus.FINISHED
        )
        self.fail(
            f"rank 0 (worker {rank0.worker_id} on node {rank0.host[:8]}) was lost after {done} returned from "
            f"train_fn: {reason}. train_fn's return value on rank 0, the run's result, is lost with it; no other "
            "rank can train on to give it (they have returned)"
        )

    def _fail_uneven_finish(self, msg: m.ResetRequested) -> None:
        """A rank's ring broke after another rank returned from train_fn: the ranks did not finish together."""
        done = [f"rank {self.plan[w].rank} ({w})" for w in self.plan if self.workers[w].status is WorkerStatus.FINISHED]
        running = [
            f"rank {self.plan[w].rank} ({w})"
            for w in self.plan
            if self.workers[w].status in (WorkerStatus.MEMBER, WorkerStatus.LEAVING)
        ]
        self.fail(
            f"{', '.join(done)} returned from train_fn while {', '.join(running) or 'others'} still ran collectives "
            f"with it (worker {msg.worker_id}: {msg.reason}). Every rank must leave train_fn at the same step: "
            "give every rank the same number of batches (ElasticSampler pads the epoch to an even split)"
        )

    def _on_activity(self, msg: m.ActivityReport, now: float) -> None:
        if self._querying == msg.generation:
            self._querying = None
        if msg.generation != self.generation:
            return  # the ring was re-formed meanwhile
        if self.finishing:
            # the ring broke as a rank returned from train_fn (its peers' error can beat its exit to us)
            self._fail_uneven_finish(m.ResetRequested(msg.worker_id, msg.generation, msg.reason))
            return
        verdict = judge_ring_failure(
            msg.activity,
            collective_timeout=self.config.collective_timeout,
            liveness_timeout=self.config.liveness_timeout,
            last_timeout_reset=self._last_timeout_reset,
            now=now,
        )
        if verdict.verdict is Ring.KILL:
            logger.warning("ring of generation %d broke: %s; killing them", msg.generation, verdict.reason)
            for worker_id in verdict.kill:
                rec = self.workers[worker_id]
                if rec.status in ALIVE:
                    self._fence(rec, verdict.reason, now)
        elif verdict.verdict is Ring.FAIL:
            self.fail(
                f"{verdict.reason} (generations {self.generation - 1} and {self.generation}; last error, "
                f"worker {msg.worker_id}: {msg.reason})"
            )
        elif verdict.verdict is Ring.REFORM:
            self._causes.append(f"worker {msg.worker_id}: {msg.reason}")
            self._last_timeout_reset = now
            self._unbound.append(self._event(EventKind.RESET_REQUESTED, f"worker {msg.worker_id}: {msg.reason}", now))
            self._force = True

    def _on_kv_restarted(self, msg: m.KVRestarted, now: float) -> None:
        """The KV actor came back empty. Between resets that costs nothing: the rings need no keys.

        During a reset (a generation whose ranks still sync, or form their
        ring) the keys its ranks wrote are gone: the ring is formed once more,
        in a new generation with the same members.
        """
        ev = self._event(EventKind.KV_RESTARTED, f"the rendezvous (KV) actor restarted ({msg.reason})", now)
        ev.reset_duration = 0.0
        self.events.append(ev)
        if self.generation == 0:
            return
        self._actions.append(m.RestoreKV(self.generation, dict(self.plan)))
        if self._syncing:
            logger.warning("the KV actor restarted during a reset: generation %d forms again", self.generation)
            self._force = True

    # ---- generations ---------------------------------------------------------------
    def _maybe_publish(self, now: float) -> None:
        """Publish the next generation if membership changed and it may form now."""
        force, self._force = self._force, False
        if self.finishing:
            return  # a member finished: the others finish the same generation
        ready = [r.worker_id for r in self.live(WorkerStatus.READY, WorkerStatus.MEMBER)]
        verdict, reason = self._publish_verdict(ready, force)
        if verdict is PublishVerdict.UNCHANGED:
            if self._waiting_since is not None and self.plan:
                logger.info("driver: the current generation is whole again; no longer waiting")
                self._waiting_since = None
        elif verdict is PublishVerdict.ALL_LOST:
            self._all_lost()
        elif verdict is PublishVerdict.BELOW_MIN:
            if self._waiting_since is None:
                logger.info("driver: waiting (%s)", reason)
                self._waiting_since = now
        elif verdict is PublishVerdict.NOW:
            logger.info("driver: publishing generation %d (%s)", self.generation + 1, reason)
            self._publish(ready, now)

    def _publish_verdict(self, ready: Sequence[str], force: bool) -> tuple[PublishVerdict, str]:
        return decide_publish(
            current=self.plan,
            ready=ready,
            alive=set(self.alive_ids()),
            leaving=[r.worker_id for r in self.live(WorkerStatus.LEAVING)],
            starting=len(self.live(WorkerStatus.STARTING)),
            min_workers=self.config.min_workers,
            force=force,
        )

    def _all_lost(self) -> None:
        """Nobody holds the trained state: go on only from a durable checkpoint (`CheckpointFound` answers)."""
        if self.config.checkpoint_dir is None:
            self._fail_all_lost("configure checkpoint_dir to resume from a durable checkpoint")
        elif not self._checkpoint_lookup:
            self._checkpoint_lookup = True
            self._actions.append(m.LookForCheckpoint())

    def _on_checkpoint_found(self, msg: m.CheckpointFound, now: float) -> None:
        self._checkpoint_lookup = False
        lost = len(self.plan)
        if msg.error is not None:
            self._fail_all_lost(
                f"the durable checkpoint in {self.config.checkpoint_dir} could not be looked for within "
                f"elastic_timeout={self.config.elastic_timeout:g} s: {msg.error}"
            )
            return
        if not msg.exists:
            self._fail_all_lost("no durable checkpoint was written yet")
            return
        self._unbound.append(
            self._event(
                EventKind.RESTARTED,
                f"all {lost} workers of generation {self.generation} were lost; fresh workers resume "
                f"from the durable checkpoint in {self.config.checkpoint_dir}",
                now,
            )
        )
        self.plan = {}
        if self._waiting_since is None:
            self._waiting_since = now

    def _fail_all_lost(self, why: str) -> None:
        causes = "".join(f"\n  {cause}" for cause in self._causes)
        self.fail(
            f"all {len(self.plan)} workers of generation {self.generation} failed; no survivor holds the training "
            f"state, so the run cannot continue ({why}){': ' + causes if causes else ''}"
        )

    def _publish(self, ready: Sequence[str], now: float) -> None:
        leavers = self._pending_leavers()
        preempted = [r for r in leavers if r.host in self.draining]
        withdrawn = [r for r in leavers if r.host not in self.draining]
        for host in sorted({r.host for r in preempted}):
            names = ", ".join(r.worker_id for r in preempted if r.host == host)
            deadline = self.draining[host]
            left = f"deadline in {deadline - (now + self.wall_offset):.0f} s" if deadline else "no deadline"
            detail = f"preempted: node {host[:8]} is draining ({left}); {names} leave"
            self._unbound.append(self._event(EventKind.PREEMPTED, detail, now))
        if withdrawn:
            names = ", ".join(f"{r.worker_id} on node {r.host[:8]}" for r in withdrawn)
            self._unbound.append(self._event(EventKind.HOSTS_REMOVED, f"hosts withdrawn: {names} leave", now))
        previous = list(self.plan)
        old_size = len(previous)
        self.generation += 1
        self.plan = assign_ranks([LiveWorker(w, self.workers[w].host, self.workers[w].seq) for w in ready])
        for worker_id in ready:
            self.workers[worker_id].status = WorkerStatus.MEMBER
        notify = tuple(w for w in previous if self.workers[w].status in (WorkerStatus.MEMBER, WorkerStatus.LEAVING))
        # the plan and who must sync are recorded before the shell publishes: a sync that
        # arrives right after the publish finds them
        self._syncing = set(self.plan)
        self._synced_commits = None
        self._waiting_since = None
        self._actions.append(m.Publish(self.generation, self.plan, notify))
        size = len(self.plan)
        self._actions.append(m.RecordMetric("world_size", size))
        wall = now + self.wall_offset
        if self.generation == 1:
            start = self._event(EventKind.START, f"{size} workers", now)
            start.time = self.started_at + self.wall_offset
            self._unbound.append(start)
        else:
            self._actions.append(m.RecordMetric("reset"))
            logger.info("generation %d: world size %d -> %d", self.generation, old_size, size)
        booting = []
        for ev, newcomers in self._booting:
            if newcomers & set(self.plan):
                # the others' pause starts now; the boot before it cost them nothing
                ev.detail += f", admitted after booting {wall - ev.time:.1f} s"
                ev.time = wall
                self._unbound.append(ev)
            elif any(self.workers[w].status in (WorkerStatus.STARTING, WorkerStatus.READY) for w in newcomers):
                booting.append((ev, newcomers))  # still booting: announced by the generation that admits them
        self._booting = booting
        if any(ev.kind is not EventKind.RESET_REQUESTED for ev in self._unbound):
            self._last_timeout_reset = None  # the membership changed: a later timeout is a new story
        for ev in self._unbound:
            ev.generation = self.generation
            ev.previous_world_size = old_size
            ev.world_size = size
            self.events.append(ev)
        self._unbound = []
        limit = self.config.reset_limit
        if limit is not None and self.resets > limit:
            self.fail(f"reset_limit={limit} reached: {self.resets} resets")

    def _on_synced(self, msg: m.WorkerSynced) -> None:
        if msg.generation != self.generation or msg.worker_id not in self._syncing:
            return
        self._syncing.discard(msg.worker_id)
        if msg.commits is not None:
            self._synced_commits = max(self._synced_commits or 0, msg.commits)
        if self._syncing:
            return
        self._check_crash_loop(msg.generation)
        for ev in self.events.of_generation(msg.generation):
            if ev.reset_duration is None:
                ev.reset_duration = max(0.0, msg.at - ev.time)
                if ev.kind is not EventKind.START:
                    self._actions.append(m.RecordMetric("recovery", ev.reset_duration))
                    logger.info("%s; recovered in %.2f s, world size %d", ev.detail, ev.reset_duration, ev.world_size)

    def _check_crash_loop(self, generation: int) -> None:
        """A generation that a failure made has synced: note where it resumed, and stop a repeating failure."""
        place, self._synced_commits = self._synced_commits, None
        failures = [e for e in self.events.of_generation(generation) if e.kind in _FAILURE_KINDS]
        if place is None or not failures:
            return
        self._failure_places.append(place)
        causes, self._causes = self._causes, []
        self._failure_reasons.append(causes[0] if causes else failures[0].detail)
        del self._failure_places[:-CRASH_LOOP_REPEATS], self._failure_reasons[:-CRASH_LOOP_REPEATS]
        loop, reason = decide_crash_loop(self._failure_places, self._failure_reasons)
        if loop:
            self.fail(reason)

    def _on_resumed(self, msg: m.WorkerResumed, now: float) -> None:
        meta: Mapping[str, Any] = msg.meta
        wall = now + self.wall_offset
        age = wall - meta.get("written_at", wall)
        ev = self._event(
            EventKind.RESUMED,
            f"worker {msg.worker_id} (rank 0) loaded the durable checkpoint of commit {meta.get('commit')} "
            f"(written {age:.1f} s ago at world size {meta.get('world_size')})",
            now,
        )
        ev.reset_duration = 0.0
        self.events.append(ev)

    def _event(self, kind: EventKind, detail: str, now: float) -> Event:
        return Event(
            time=now + self.wall_offset, kind=kind, world_size=len(self.plan), generation=self.generation, detail=detail
        )
