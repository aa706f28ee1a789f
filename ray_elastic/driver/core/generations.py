"""Membership and generations: who is in the ring, and when the next one is planned and published.

A generation is one ring: its members and their ranks (`assignment.assign_ranks`:
the workers that finished a sync before newcomers, each oldest first, so rank 0
holds the newest commit among the members). It is published once per
batch of messages, at the end, when the members changed and the new world
may form (`policies.decide_publish`): deaths that arrive together join one
reset. Events waiting for the generation that absorbs them (a death, hosts
added or withdrawn) are bound to it when it is published, and its reset
ends when its last member synced: that is each event's `reset_duration`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, NamedTuple

from ray_elastic.assignment import Plan, assign_ranks, order_key
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.phase import RESETTING, RUNNING, WAITING
from ray_elastic.driver.core.policies import PublishVerdict, decide_publish
from ray_elastic.driver.core.roster import ALIVE, WorkerRecord, WorkerStatus
from ray_elastic.protocol import DriverState, EventKind

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from ray_elastic.driver.core.run_record import RunRecord
    from ray_elastic.events import Event

logger = logging.getLogger(__name__)


class Published(NamedTuple):
    """What `maybe_publish` found: its verdict, and whether a published generation changed the membership."""

    verdict: PublishVerdict | None  # None: nothing to decide (the run is finishing)
    membership_changed: bool = False  # it absorbed a change other than a ring re-formed as it was


class Syncing(Collection[str]):
    """The members of the newest generation still syncing: its plan less the members that synced.

    Not a set of the members: at thousands of them, a new generation would
    build one, and the snapshot after it pickle one, at every reset.
    """

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._synced: set[str] = set()

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._plan and worker_id not in self._synced

    def __len__(self) -> int:
        return len(self._plan) - len(self._synced)

    def __iter__(self) -> Iterator[str]:
        return (w for w in self._plan if w not in self._synced)

    def __repr__(self) -> str:
        return f"Syncing({sorted(self)!r})"

    def discard(self, worker_id: str) -> None:
        """`worker_id` synced (or needs not): once every member has, the plan is let go."""
        if worker_id in self:
            self._synced.add(worker_id)
            if len(self._synced) == len(self._plan):
                self._plan, self._synced = Plan([], []), set()


class Generations:
    """The current generation, the one being synced, and the events waiting for the next."""

    def __init__(self, record: RunRecord) -> None:
        self.record = record
        self.generation = 0
        self.plan = Plan([], [])
        self.syncing = Syncing(self.plan)  # members of the newest generation still syncing
        self._unbound: list[Event] = []  # changes not yet absorbed by a generation
        # hosts_added events and the newcomers each announces: bound to the generation that admits one of them
        self._booting: list[tuple[Event, frozenset[str]]] = []
        self._synced_commits: int | None = None  # the newest generation's commits, as its ranks synced
        self._force = False  # re-form the ring at the end of this batch even with the same members
        self._dropped: list[str] = []  # the members of a generation given up for a durable restart: told the next
        self._mark: tuple[int, int] | None = None  # the roster's journal when the plan was published

    def __getstate__(self) -> dict:
        # the journal is not pickled: a restarted driver plans its next generation whole
        return {**self.__dict__, "_mark": None}

    @property
    def resets(self) -> int:
        return max(0, self.generation - 1)

    def event(self, kind: EventKind, detail: str, now: float, paused: bool = True) -> Event:
        """An event at `now`, in the current generation and world size (re-bound if it waits for the next).

        `paused=False`: a note that stopped no training (a slow data block): it has no reset to wait for.
        """
        ev = self.record.event(kind, detail, now, len(self.plan), self.generation)
        if not paused:
            ev.reset_duration = 0.0
        return ev

    # ---- what the other parts tell it ----------------------------------------------
    def later(self, event: Event) -> None:
        """`event` belongs to the generation that absorbs it: the next one published."""
        self._unbound.append(event)

    def reform(self) -> None:
        """Form the ring again at the end of this batch, even with the same members."""
        self._force = True

    def announce(self, event: Event, newcomers: frozenset[str]) -> None:
        """Newcomers are booting: `event` is told by the generation that admits one of them."""
        self._booting.append((event, newcomers))

    def names(self, worker_id: str) -> bool:
        """Whether a generation, a sync or a boot announcement still names `worker_id` (it stays on record)."""
        return (
            worker_id in self.plan
            or worker_id in self.syncing
            or any(worker_id in newcomers for _, newcomers in self._booting)
        )

    def pending_leavers(self) -> list[WorkerRecord]:
        """Members withdrawn by discovery whose leaving no generation has carried out yet."""
        return [r for r in self.record.roster.live(WorkerStatus.LEAVING) if r.worker_id in self.plan]

    @property
    def waiting_since(self) -> float | None:
        """Since when the run has been below `min_workers` (None: it is not waiting)."""
        phase = self.record.phase
        return phase.since if phase.current is WAITING else None

    def start_waiting(self, now: float, reason: str) -> None:
        """Wait for `min_workers` again (unless the run waits already): `elastic_timeout` runs from `now`."""
        if self.record.phase.current is not WAITING:
            self.record.phase.move(WAITING, reason, now)

    def _trained_phase(self) -> DriverState:
        """The phase of a run that is not waiting: resetting while a generation after the first still syncs."""
        return RESETTING if self.generation > 1 and self.syncing else RUNNING

    def lost_holders(self) -> list[str]:
        """The members that held the trained state and are gone (all members, if none had synced yet)."""
        roster = self.record.roster
        gone = [w for w in self.plan if roster[w].status not in ALIVE]
        return [w for w in gone if roster[w].holds_state] or gone

    def holder_alive(self) -> bool:
        """Whether a member of the current generation that holds the trained state is alive."""
        roster = self.record.roster
        return any(roster[w].holds_state and roster[w].status in ALIVE for w in self.plan)

    def restart_from_checkpoint(self, now: float) -> None:
        """Every member was lost: fresh workers form the next generation from the durable checkpoint."""
        self._dropped, self.plan = list(self.plan), Plan([], [])
        self.start_waiting(now, "every member was lost: fresh workers resume from the durable checkpoint")

    def check_wait(self, now: float, cooling: int) -> bool:
        """Below `min_workers` for longer than `elastic_timeout`: the run fails, saying what it had (True)."""
        record = self.record
        timeout = record.config.elastic_timeout
        if self.waiting_since is None or now - self.waiting_since <= timeout:
            return False
        ready = len(record.roster.live(WorkerStatus.READY, WorkerStatus.MEMBER))
        if ready >= record.config.min_workers:
            return False  # min_workers are here: what is waited for is a newcomer's boot, bounded by its own deadline
        record.fail(
            f"min_workers={record.config.min_workers} not reached within elastic_timeout={timeout:g} s "
            f"(ready workers: {ready}; slots offered: {sum(record.hosts.values())}; hosts cooling down: {cooling})"
        )
        return True

    # ---- planning and publishing --------------------------------------------------------
    def maybe_publish(self, now: float, finishing: bool) -> Published:
        """Publish the next generation if membership changed and it may form now.

        `ALL_LOST` (no member left to hold the state) is the caller's to
        handle: only a durable checkpoint can go on from there.
        """
        force, self._force = self._force, False
        if finishing:
            return Published(None)  # a member finished: the others finish the same generation
        roster = self.record.roster
        following = self._following()
        ready: Sequence[str] | Plan
        if following is None:
            ready_records = roster.live(WorkerStatus.READY, WorkerStatus.MEMBER)
            ready = [r.worker_id for r in ready_records]
            starting = self._booting_with(roster.live(WorkerStatus.READY))
        else:
            ready, starting = following, roster.count(WorkerStatus.STARTING)  # none ready: as _booting_with([])
        verdict, reason = decide_publish(
            current=self.plan,
            ready=ready,
            alive=roster.in_status(*ALIVE),
            leaving=[r.worker_id for r in roster.live(WorkerStatus.LEAVING)],
            starting=starting,
            min_workers=self.record.config.min_workers,
            force=force,
            holds=lambda w: roster[w].holds_state,
        )
        if verdict is PublishVerdict.UNCHANGED:
            if self.waiting_since is not None and self.plan:
                logger.info("driver: the current generation is whole again; no longer waiting")
                self.record.phase.move(self._trained_phase(), f"generation {self.generation} is whole again", now)
        elif verdict is PublishVerdict.BELOW_MIN:
            if self.waiting_since is None:
                logger.info("driver: waiting (%s)", reason)
                self.start_waiting(now, reason)
        elif verdict is PublishVerdict.HOLDER_LEAVING:
            logger.error("driver: not publishing: %s (the hand-over keeps one; a bug if this repeats)", reason)
        elif verdict is PublishVerdict.NOW:
            logger.info("driver: publishing generation %d (%s)", self.generation + 1, reason)
            plan = following if following is not None else assign_ranks([r.live for r in ready_records])
            return Published(verdict, self._publish(plan, now, reason))
        return Published(verdict)

    def _following(self) -> Plan | None:
        """The next generation's plan when members only left since this one was published (a death, a leaver):
        this plan less them, found from the roster's journal, not by a pass over every worker.

        None when it must be planned whole: a newcomer is ready, the order
        of the ranks would change (`Plan.without`), or the journal does not
        reach back to the publish (a restarted driver, a long stretch of
        changes).
        """
        roster, plan = self.record.roster, self.plan
        moved = roster.journal.since(self._mark)
        if moved is None or not plan or roster.any(WorkerStatus.READY):
            return None
        gone, rekeyed = set(), set()
        for worker_id, before, after in moved:
            if worker_id not in plan:
                continue
            if before is after:
                rekeyed.add(worker_id)  # it took the state: its place in the order may change
            elif roster[worker_id].status is not WorkerStatus.MEMBER:
                gone.add(worker_id)
        # every member was MEMBER when the plan was published; each that is not any more moved since
        if len(plan) - len(gone) != roster.count(WorkerStatus.MEMBER):
            return None
        return plan.without(gone, lambda w: order_key(roster[w].live), rekeyed)

    def _booting_with(self, ready: Sequence[WorkerRecord]) -> int:
        """The newcomers still booting that the ready ones wait for: those started with them or before.

        Newcomers started together are admitted together (one reset, not
        one per boot); one started later (a replacement of a boot that
        failed) does not hold back those ready: a host whose boots keep
        failing would otherwise keep them out for ever.
        """
        roster = self.record.roster
        latest = max((r.started_at for r in ready), default=None)
        if latest is None:
            return roster.count(WorkerStatus.STARTING)
        return sum(1 for r in roster.live(WorkerStatus.STARTING) if r.started_at <= latest)

    def _publish(self, plan: Plan, now: float, reason: str) -> bool:
        """Publish `plan` as the next generation; whether it absorbed a change other than a ring re-formed."""
        record, roster = self.record, self.record.roster
        self._tell_leavers(now)
        old, dropped, self._dropped = self.plan, self._dropped, []
        old_size = len(old)
        self.generation += 1
        self.plan = plan
        # the stragglers it leaves out are gone; one held over stays
        for worker_id in [w for w in record.evicted if w not in plan]:
            record.evicted.discard(worker_id)
        for rec in roster.live(WorkerStatus.READY):  # the others of the plan are members already
            roster.move(rec, WorkerStatus.MEMBER, f"admitted to generation {self.generation}")
            rec.admit(self.generation)
        ended = roster.ids(WorkerStatus.GONE, WorkerStatus.FINISHED)  # a plan's members are never starting
        if old:  # a plan's members stay on record while it is current
            notify = tuple(old.ids_except(ended))
        else:  # after a durable restart the plan was emptied: its members still alive (leaving) are told all the same
            notify = tuple(w for w in dropped if w not in ended and w in roster.workers)
        # the plan and who must sync are recorded before the shell publishes: a sync that
        # arrives right after the publish finds them
        self.syncing = Syncing(plan)
        self._mark = roster.journal.mark()  # every member is MEMBER now: what changes from here is journaled
        self._synced_commits = None
        record.phase.move(self._trained_phase(), f"generation {self.generation} published ({reason})", now)
        record.act(m.Publish(self.generation, self.plan.view(), notify))
        size = len(self.plan)
        record.act(m.RecordMetric("world_size", size))
        if self.generation == 1:
            start = self.event(EventKind.START, f"{size} workers", now)
            start.time = record.started_at + record.wall_offset
            self._unbound.append(start)
        else:
            record.act(m.RecordMetric("reset"))
            logger.info("generation %d: world size %d -> %d", self.generation, old_size, size)
        self._admit_booted(now)
        changed = any(ev.kind is not EventKind.RESET_REQUESTED for ev in self._unbound)
        for ev in self._unbound:
            ev.generation = self.generation
            ev.previous_world_size = old_size
            ev.world_size = size
            record.events.append(ev)
        self._unbound = []
        limit = record.config.reset_limit
        if limit is not None and self.resets > limit:
            record.fail(f"reset_limit={limit} reached: {self.resets} resets")
        return changed

    def _tell_leavers(self, now: float) -> None:
        """The events of members this generation leaves out: preempted (a draining node) or withdrawn.

        A straggler let go has its own event already (`pace_watch.py`).
        """
        record, draining = self.record, self.record.draining
        leavers = [r for r in self.pending_leavers() if r.worker_id not in record.evicted]
        preempted = [r for r in leavers if r.host in draining]
        withdrawn = [r for r in leavers if r.host not in draining]
        for host in sorted({r.host for r in preempted}):
            names = ", ".join(r.worker_id for r in preempted if r.host == host)
            deadline = draining[host]
            left = f"deadline in {deadline - (now + record.wall_offset):.0f} s" if deadline else "no deadline"
            detail = f"preempted: node {host[:8]} is draining ({left}); {names} leave"
            self._unbound.append(self.event(EventKind.PREEMPTED, detail, now))
        if withdrawn:
            names = ", ".join(f"{r.worker_id} on node {r.host[:8]}" for r in withdrawn)
            self._unbound.append(self.event(EventKind.HOSTS_REMOVED, f"hosts withdrawn: {names} leave", now))

    def _admit_booted(self, now: float) -> None:
        """Newcomers this generation admits: their hosts_added event is told now, when the others' pause starts."""
        wall = now + self.record.wall_offset
        roster = self.record.roster
        booting = []
        for ev, newcomers in self._booting:
            if any(w in self.plan for w in newcomers):
                # the others' pause starts now; the boot before it cost them nothing
                ev.detail += f", admitted after booting {wall - ev.time:.1f} s"
                ev.time = wall
                self._unbound.append(ev)
            elif any(roster[w].status in (WorkerStatus.STARTING, WorkerStatus.READY) for w in newcomers):
                booting.append((ev, newcomers))  # still booting: announced by the generation that admits them
        self._booting = booting

    # ---- the reset's end ------------------------------------------------------------
    def on_synced(self, msg: m.WorkerSynced) -> tuple[bool, int | None]:
        """A member synced. When the last one has, the generation's events get their reset's duration.

        Returns whether the generation has now synced whole, and the commit
        its ranks resumed from (None when none said), for the crash-loop check.
        """
        if msg.generation < self.generation:
            # late: the next generation was published before this word came, but the worker did receive the
            # state then, and holds it now; a death before its sync in the newest generation must not lose it
            rec = self.record.roster.get(msg.worker_id)
            if rec is not None and rec.status in ALIVE:
                rec.took_state()
            return False, None
        if msg.generation != self.generation or msg.worker_id not in self.syncing:
            return False, None
        self.syncing.discard(msg.worker_id)
        self.record.roster[msg.worker_id].took_state()
        if msg.commits is not None:
            self._synced_commits = max(self._synced_commits or 0, msg.commits)
        if self.syncing:
            return False, None
        if self.record.phase.current is RESETTING:
            self.record.phase.move(RUNNING, f"every member of generation {self.generation} synced", self.record.now)
        place, self._synced_commits = self._synced_commits, None
        for ev in self.record.events.open_events(msg.generation):  # a replaced generation's end with this one
            if ev.reset_duration is None:
                ev.reset_duration = max(0.0, msg.at - ev.time)
                if ev.kind is not EventKind.START:
                    self.record.act(m.RecordMetric("recovery", ev.reset_duration))
                    logger.info("%s; recovered in %.2f s, world size %d", ev.detail, ev.reset_duration, ev.world_size)
        return True, place
