"""Scaling and admission: the hosts discovery offers, draining nodes, newcomers and leavers, the autoscaler.

After every batch the workers are brought in line with the hosts
(`assignment.plan_scaling`): newcomers are started on hosts with free slots
(not on a draining node, not on a host cooling down), members on a host no
longer offered leave gracefully with the next generation, and the run asks
Ray's autoscaler for the slots still missing up to `max_workers`. A host
missing from one discovery poll only is kept until the next (a blip is
absorbed). When every member that holds the trained state leaves at once
(discovery withdraws them, or they are let go as stragglers), one holder
stays until a generation of the others has synced whole: the state is
handed over, never dropped; with no other worker left (`max_workers=1`),
the newcomer that takes it starts one over `max_workers` for the hand-over.
A straggler let go also stays while the next generation would be below
`min_workers` without it.
"""

from __future__ import annotations

import logging
from collections import Counter
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

from ray_elastic.assignment import Cooldown, plan_scaling
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.roster import IN_RING, WorkerRecord, WorkerStatus
from ray_elastic.driver.core.spares import Spares
from ray_elastic.protocol import EventKind

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ray_elastic.driver.core.generations import Generations
    from ray_elastic.driver.core.run_record import RunRecord

logger = logging.getLogger(__name__)

_BY_SEQ = attrgetter("seq")
_STAYING = frozenset({WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.MEMBER})


class _Steady(NamedTuple):
    """What the last plan left, for telling the slots that deaths since then freed (`Scaling._after_deaths`)."""

    mark: tuple[int, int]  # the roster's journal after it
    hosts: dict[str, int]  # the hosts it planned with (the record's dict: a new view is a new dict)
    host_count: int  # their number (a node that died is popped from the same dict)
    draining: dict[str, float]
    free: dict[str, int]  # the hosts with free usable slots, and how many
    room: int  # max_workers less the workers staying


class Scaling:
    """Who should run where: newcomers started, leavers let go, the autoscaler asked."""

    def __init__(self, record: RunRecord, generations: Generations, cooldown: Cooldown) -> None:
        self.record = record
        self.generations = generations
        self.cooldown = cooldown
        self.host_first_seen: dict[str, float] = {}
        self._missing_once: set[str] = set()  # hosts the last poll did not offer, kept for one more poll
        self._holding: str | None = None  # the withdrawn member kept to hand the trained state over
        self._autoscale_requested = 0
        self._steady: _Steady | None = None  # not pickled: a restarted driver plans whole
        self.spares = Spares(record, generations, self.host_first_seen)
        self._all_offered: tuple[dict[str, int], int] | None = None  # the hosts, and their number, then

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_steady": None, "_all_offered": None}

    # ---- what the cluster says ---------------------------------------------------------
    def update_hosts(self, offered: Mapping[str, int], now: float) -> bool:
        """Take discovery's view; a host missing from one poll only is kept until the next (a blip is absorbed).

        Returns whether the view changed (the same hosts again change nothing).
        """
        hosts = self.record.hosts
        if offered == hosts and not self._missing_once:
            return False
        for host in offered:
            self.host_first_seen.setdefault(host, now)
        missing = {h: n for h, n in hosts.items() if h not in offered and h not in self._missing_once}
        if missing:
            logger.info("discovery no longer offers %s; kept until the next poll confirms it", sorted(missing))
        self._missing_once = set(missing)
        self.record.hosts = {**missing, **offered}
        return True

    def on_draining(self, deadlines: Mapping[str, float], now: float) -> None:
        """Ray drains these nodes (a preemption notice): their workers leave at their next check."""
        for node in set(deadlines) - set(self.record.draining):
            deadline = deadlines[node]
            left = f"{deadline - (now + self.record.wall_offset):.0f} s" if deadline else "no deadline"
            logger.warning("node %s is draining (%s): its workers leave at their next check", node[:8], left)
        self.record.draining = dict(deadlines)

    # ---- bringing the workers in line -------------------------------------------------
    def reconcile(self, now: float) -> None:
        """Bring the workers in line with the hosts: start newcomers, let leavers go, keep the hot spares."""
        add = self._after_deaths(now)
        steady = add is not None
        if add is None:
            add, steady = self._plan_whole(now)
        added = [self._spawn(host, now) for host, count in add.items() for _ in range(count)]
        gens = self.generations
        if added and gens.generation > 0:
            detail = f"{len(added)} new worker(s) {self._where(add)}"
            gens.announce(gens.event(EventKind.HOSTS_ADDED, detail, now), frozenset(added))
        if self.record.config.spares:
            self.spares.fill(now)
            self.spares.top_up(self._spare_hosts(now), now)
        self._request_autoscale()
        if steady and self._steady is not None:
            free = {h: n - add.get(h, 0) for h, n in self._steady.free.items()}
            free = {h: n for h, n in free.items() if n > 0}
            room = self._steady.room - len(added)
            self._steady = self._steady._replace(mark=self.record.roster.journal.mark(), free=free, room=room)
        else:
            self._steady = None

    def _after_deaths(self, now: float) -> dict[str, int] | None:
        """The newcomers to start when workers only died since the last plan, which left everyone in place:
        `plan_scaling`'s answer from the slots the dead freed (`_Steady`), without a pass over every worker or
        host. None: plan whole (anything else changed, or the journal does not reach back)."""
        steady, record = self._steady, self.record
        if (
            steady is None
            or record.config.spares  # spares move between statuses `_STAYING` does not know: plan whole
            or record.hosts is not steady.hosts
            or len(record.hosts) != steady.host_count
            or record.draining != steady.draining
            or record.evicted
            or record.benched
            or self._missing_once
        ):
            return None
        moved = record.roster.journal.since(steady.mark)
        if moved is None:
            return None
        free, room = dict(steady.free), steady.room
        for worker_id, before, after in moved:
            if before is after or (before in _STAYING and after in _STAYING):
                continue  # it took the state, said it is ready or was admitted: the counts stay
            rec = record.roster.get(worker_id)
            if rec is None or before not in _STAYING or after is not WorkerStatus.GONE:
                return None
            free[rec.host] = free.get(rec.host, 0) + 1
            room += 1
        self._steady = steady._replace(free=free, room=room)
        cooling = self.cooldown.cooling(now)
        add: dict[str, int] = {}
        for host in sorted(free, key=lambda h: (self.host_first_seen.get(h, float("inf")), h)):
            if room <= 0:
                break
            if host not in cooling:
                add[host] = min(free[host], room)
                room -= add[host]
        return add

    def _plan_whole(self, now: float) -> tuple[dict[str, int], bool]:
        """`plan_scaling` over every worker: the newcomers to start, and whether its plan left everyone in place
        (then `_Steady` keeps what the next batch needs to tell the slots deaths free)."""
        record, config = self.record, self.record.config
        roster, evicted = record.roster, record.evicted
        # stragglers let go leave whatever the hosts offer: their slots are held out of the plan (`record.benched`)
        leavers = [r for r in self.generations.pending_leavers() if r.worker_id not in evicted]
        live = roster.live(WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.MEMBER)
        staying = [r for r in live if r.worker_id not in evicted] + leavers
        usable = self._usable_hosts(staying)
        if config.spares:
            self.spares.fit(usable, staying, self._missing_once)  # members first: a spare holds what they leave
        decision = plan_scaling(
            [r.live for r in staying],
            usable,
            self.host_first_seen,
            self.cooldown.cooling(now),
            config.max_workers,
        )
        remove = set(decision.remove)
        held = self._hold_over(remove)
        for rec in sorted((roster[w] for w in remove), key=_BY_SEQ):  # a few: not a pass over every worker
            if rec.status in IN_RING:
                roster.move(rec, WorkerStatus.LEAVING, "its host is withdrawn")  # leaves with the next generation
            else:
                record.let_go(rec, "its host is withdrawn, or the world is above max_workers")
        for rec in leavers:
            if rec.worker_id not in remove:
                logger.info("worker %s stays: its host is offered again before it left", rec.worker_id)
                roster.move(rec, WorkerStatus.MEMBER, "its host is offered again")
        kept = self._keep_stragglers(held, remove)
        add = self._room_for(held, staying, remove, dict(decision.add), len(kept - {held}))
        if config.spares:
            return self.spares.promote(add, now), False
        in_place = not (remove or held or kept or leavers or evicted or record.benched or self._missing_once)
        if in_place and not roster.any(WorkerStatus.LEAVING):
            counts = Counter(r.host for r in staying)
            free = {h: n - counts[h] for h, n in usable.items() if n > counts[h]}
            self._steady = _Steady(
                (0, 0), record.hosts, len(record.hosts), dict(record.draining), free, config.max_workers - len(staying)
            )
            return add, True
        return add, False

    def _keep_stragglers(self, held: str | None, remove: set[str]) -> set[str]:
        """The stragglers let go that stay for now: the one holding the state over, and as many as the next
        generation needs to reach min_workers (members died or were withdrawn after they were let go)."""
        gens, roster, evicted = self.generations, self.record.roster, self.record.evicted
        kept = {held} if held is not None else set()
        if not evicted:
            return kept
        # the members that stay: not the one held over, which leaves once it has handed the state on
        members = [
            w for w in gens.plan if roster[w].status in IN_RING and w not in evicted and w not in remove and w != held
        ]
        short = self.record.config.min_workers - len(members) - roster.count(WorkerStatus.READY)
        for worker_id in sorted(evicted, key=lambda w: roster[w].seq if w in roster.workers else 0):
            straggler = roster.get(worker_id)
            if straggler is None or straggler.status not in IN_RING or worker_id not in gens.plan:
                continue
            if worker_id == held:
                roster.move(straggler, WorkerStatus.MEMBER, "let go as a straggler, held over to hand the state on")
            elif short > 0:
                kept.add(worker_id)
                short -= 1
                roster.move(straggler, WorkerStatus.MEMBER, "let go as a straggler, kept while below min_workers")
            else:
                roster.move(straggler, WorkerStatus.LEAVING, "let go as a straggler")
        return kept

    def _room_for(
        self, held: str | None, staying: list[WorkerRecord], remove: set[str], add: dict[str, int], kept: int = 0
    ) -> dict[str, int]:
        """The newcomers to start: the held-over worker counts toward max_workers, but a hand-over needs a taker.

        With no other worker staying (`max_workers=1`, a whole pool
        replaced), one newcomer starts beyond `max_workers` for as long as
        the hand-over lasts (its generation's sync): the alternative is a
        holder that never leaves a withdrawn host, or a restart that throws
        away every step since the last durable checkpoint.
        """
        if held is None and not kept:
            return add
        if held is None:  # stragglers kept for min_workers count toward max_workers
            world = len(staying) - len(remove) + kept + sum(add.values())
            for host in reversed(list(add)):
                while world > self.record.config.max_workers and add[host]:
                    add[host] -= 1
                    world -= 1
            return add
        max_workers = self.record.config.max_workers
        # besides the held one: the stragglers kept count too
        others = len(staying) - len(remove) - (0 if held in self.record.evicted else 1) + kept
        world = others + 1 + sum(add.values())
        keep = 0 if others else 1
        for host in reversed(list(add)):
            while world > max_workers and add[host] and sum(add.values()) > keep:
                add[host] -= 1
                world -= 1
        if world > max_workers:
            logger.warning(
                "worker %s hands the trained state over to a newcomer: the world is %d, over max_workers=%d, "
                "until the newcomer synced",
                held,
                world,
                max_workers,
            )
        return add

    def _usable_hosts(self, staying: list[WorkerRecord]) -> dict[str, int]:
        """Slots to plan with: none on a draining node, none held for a straggler cooling down (`Bench`); on a
        host kept for the blip grace, its workers'."""
        usable = {}
        benched = self.record.benched
        for host, slots in self.record.hosts.items():
            if host in self.record.draining:
                continue
            if benched and host in benched:
                slots = benched.usable(host, slots)
            if host in self._missing_once:  # it may be gone for good: keep its workers, start none there
                slots = min(slots, sum(r.host == host for r in staying))
            usable[host] = slots
        return usable

    def _spare_hosts(self, now: float) -> dict[str, int]:
        """The slots hot spares may start on: the usable ones (a host missing from the last poll has none to
        start on), on hosts not cooling down."""
        cooling = self.cooldown.cooling(now)
        return {h: n for h, n in self._usable_hosts([]).items() if n and h not in cooling}

    def _hold_over(self, remove: set[str]) -> str | None:
        """Keep one holder of the trained state among the members leaving, until the state is handed over.

        Members leave when discovery withdraws their host (`remove`) or when
        they are let go as stragglers (`record.evicted`). If no member that
        stays holds the state in a generation synced whole, one of the
        leavers stays: a holder (one that finished a sync; the stragglers
        last, as they are slow), oldest first; the oldest when none synced
        yet. Whole, not as soon as one newcomer said so: the others' word
        can come after it, and that one dying then would leave no holder the
        driver knows of. Never a newcomer that did not sync while a holder
        lives: its untrained state would be handed to everyone.
        """
        gens, roster, evicted = self.generations, self.record.roster, self.record.evicted
        if not remove and not evicted:
            return None  # nobody leaves: no pass over the members
        in_ring = [w for w in gens.plan if roster[w].status in IN_RING]
        leaving = [roster[w] for w in in_ring if w in remove or w in evicted]
        if not leaving:
            return None
        staying = [w for w in in_ring if w not in remove and w not in evicted]
        if staying and not any(w in gens.syncing for w in staying) and any(roster[w].holds_state for w in staying):
            return None
        holders = [r for r in leaving if r.holds_state]
        pool = [r for r in holders if r.worker_id not in evicted] or holders
        pool = pool or [r for r in leaving if r.worker_id not in evicted] or leaving
        keep = min(pool, key=_BY_SEQ)
        remove.discard(keep.worker_id)
        if self._holding != keep.worker_id:
            self._holding = keep.worker_id
            logger.warning(
                "every worker holding the trained state is leaving; worker %s on node %s stays until the others "
                "received it",
                keep.worker_id,
                keep.host[:8],
            )
        return keep.worker_id

    def _where(self, add: Mapping[str, int]) -> str:
        """Which nodes newcomers start on, for the event's line: a node back from its cool-down says so."""
        hosts = [h for h, count in add.items() if count]
        back = [h for h in hosts if self.cooldown.remembers(h)]
        names = ", ".join(h[:8] for h in hosts)
        where = f"on node {names}" if len(hosts) == 1 else f"on nodes {names}"
        if back and len(hosts) == 1:
            where += " (back after its cool-down)"
        elif back:
            where += f" ({', '.join(h[:8] for h in back)} back after its cool-down)"
        return where

    def _spawn(self, host: str, now: float) -> str:
        rec = self.record.roster.new(host, now)
        self.record.act(m.Spawn(rec.worker_id, host))
        logger.info("starting worker %s on node %s", rec.worker_id, host[:8])
        return rec.worker_id

    # ---- the autoscaler ---------------------------------------------------------------
    def _request_autoscale(self) -> None:
        """Ask Ray's autoscaler for the slots still missing up to max_workers, and the hot spares'."""
        config = self.record.config
        slots = config.max_workers + config.spares
        wanted = slots if sum(self.record.hosts.values()) < slots else 0
        if wanted != self._autoscale_requested:
            self._autoscale_requested = wanted
            self.record.act(m.RequestResources(wanted))

    def request_again(self) -> list[m.Action]:
        """The autoscaler share, for a restarted driver."""
        return [m.RequestResources(self._autoscale_requested)] if self._autoscale_requested else []

    def prune(self, now: float) -> None:
        """Forget hosts neither offered nor hosting a worker on record, a hand-over done, expired cool-downs."""
        roster = self.record.roster
        if self._holding is not None and self._holding not in roster.workers:
            self._holding = None
        hosts = self.record.hosts
        # every host seen was offered when these hosts were taken (a node that died is popped from them)
        if self._all_offered is None or self._all_offered != (hosts, len(hosts)):
            offered_no_more = self.host_first_seen.keys() - hosts.keys()
            if offered_no_more:  # rare: a scan of every worker's host only then
                in_use = roster.hosts_in_use()
                for host in offered_no_more:
                    if host not in in_use:
                        del self.host_first_seen[host]
            else:
                self._all_offered = (hosts, len(hosts))
        self.cooldown.forget(now)
