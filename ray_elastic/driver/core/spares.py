"""Hot spares (`spares=K`): workers booted ahead of need, out of every ring, promoted when a place opens.

A spare starts as any newcomer does (its placement group, its process,
torch and `train_fn`'s set-up up to the run loop, where it says it is
ready), then waits outside every ring, holding no state. When a place
opens (a member died, was withdrawn or let go as a straggler, or discovery
offers room under `max_workers`), the planner promotes spares before it
starts anyone: a ready spare joins the next generation at once and receives
the state there as any newcomer does, so no boot is on the critical path; a
spare still booting becomes a plain newcomer, further along than a fresh
start. New spares then start in the background on the slots left free.

Members come first: spares take only the slots that the members (up to
`max_workers`) leave free, so a cluster with no room beyond `max_workers` has
no spare; spares count against the cluster's resources, never against
`max_workers`. A spare goes where the fewest workers run (another node than
the members' where the cluster has one: a node's loss should not take a
member and its spare at once). A spare on a node that drains, is withdrawn
or shrinks is let go; one that dies or hangs (the liveness rounds judge
spares as any worker) is gone, never promoted, and replaced.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.roster import ALIVE, SPARES, WorkerStatus
from ray_elastic.protocol import EventKind

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

    from ray_elastic.driver.core.generations import Generations
    from ray_elastic.driver.core.roster import WorkerRecord
    from ray_elastic.driver.core.run_record import RunRecord

logger = logging.getLogger(__name__)


class Spares:
    """The run's hot spares: which to let go, which to promote, where to start new ones.

    Args:
        record: the run's record (its roster, config and actions).
        generations: for the events a promotion is told by.
        host_first_seen: when each host was first offered (spares prefer the oldest, as members do).
    """

    def __init__(self, record: RunRecord, generations: Generations, host_first_seen: Mapping[str, float]) -> None:
        self.record = record
        self.generations = generations
        self.host_first_seen = host_first_seen
        self.promoted = 0  # spares promoted into a place so far (`Result.spares_promoted`)

    def fit(self, usable: Mapping[str, int], staying: Collection[WorkerRecord], uncertain: Collection[str]) -> None:
        """Let go the spares that no longer fit beside the members: their node drains, is withdrawn, or has fewer
        slots than its members and spares need (the newest spares go). A spare on a host missing from one
        discovery poll only (`uncertain`) is kept, as its members are."""
        roster = self.record.roster
        if not roster.any(*SPARES):
            return
        taken = Counter(r.host for r in staying)
        for rec in roster.live(*SPARES):  # oldest first: the newest go
            if rec.host in uncertain:
                continue
            if taken[rec.host] >= usable.get(rec.host, 0):
                why = "its node no longer offers a slot for it" if rec.host in usable else "its node is withdrawn"
                logger.info("hot spare %s on node %s is let go: %s", rec.worker_id, rec.host[:8], why)
                self.record.let_go(rec, f"a hot spare: {why}")
            else:
                taken[rec.host] += 1

    def promote(self, add: dict[str, int], now: float) -> dict[str, int]:
        """Promote spares into the places `add` would start newcomers for (ready spares first, then booting ones,
        oldest first); returns the newcomers still to start.

        Each promoted spare takes its own slot: a place `add` planned on its
        host is taken first, else one on the host `add` prefers least, whose
        slot is then left free for a new spare.
        """
        places = sum(add.values())
        if not places or not self.record.roster.any(*SPARES):
            return add
        promoted = self._promote(places, now)
        left = dict(add)
        for rec in promoted:
            host = rec.host if left.get(rec.host) else next(h for h in reversed(list(left)) if left[h])
            left[host] -= 1
        return {h: n for h, n in left.items() if n}

    def fill(self, now: float) -> None:
        """Promote spares into the places still open under `max_workers` that no newcomer is started for: the
        planner starts none on a host cooling down, but a spare booted there already is as good as any."""
        roster = self.record.roster
        room = self.record.config.max_workers - roster.count(
            WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.MEMBER
        )
        if room > 0 and roster.any(*SPARES):
            self._promote(room, now)

    def _promote(self, places: int, now: float) -> list[WorkerRecord]:
        """Up to `places` spares into the next generation (ready ones first, oldest first), with the event."""
        roster = self.record.roster
        candidates = roster.live(WorkerStatus.SPARE) + roster.live(WorkerStatus.SPARE_BOOTING)  # each oldest first
        promoted = candidates[:places]
        if not promoted:
            return []
        for rec in promoted:
            if rec.status is WorkerStatus.SPARE:
                roster.move(rec, WorkerStatus.READY, "a hot spare, promoted into a place")
            else:
                roster.move(rec, WorkerStatus.STARTING, "a hot spare still booting, promoted into a place")
        self.promoted += len(promoted)
        names = ", ".join(f"{r.worker_id} (node {r.host[:8]})" for r in promoted)
        booting = sum(r.status is WorkerStatus.STARTING for r in promoted)
        detail = f"hot spare {names} promoted into the next generation" if len(promoted) == 1 else (
            f"{len(promoted)} hot spares promoted into the next generation: {names}"
        )
        if booting:
            detail += f" ({booting} still booting)"
        logger.info("%s", detail)
        gens = self.generations
        gens.announce(gens.event(EventKind.SPARE_PROMOTED, detail, now), frozenset(r.worker_id for r in promoted))
        return promoted

    def top_up(self, hosts: Mapping[str, int], now: float) -> None:
        """Start spares on the free slots of `hosts` until there are `spares`: each where the fewest workers run,
        the oldest host first among equals."""
        record = self.record
        roster = record.roster
        need = record.config.spares - roster.count(*SPARES)
        if need <= 0:
            return
        occupied = Counter(r.host for r in roster.live(*ALIVE) if r.host in hosts)
        free = {h: n - occupied[h] for h, n in hosts.items() if n > occupied[h]}
        while need > 0 and free:
            host = min(free, key=lambda h: (occupied[h], self.host_first_seen.get(h, float("inf")), h))
            rec = roster.new(host, now, spare=True)
            record.act(m.Spawn(rec.worker_id, host, spare=True))
            logger.info("starting hot spare %s on node %s", rec.worker_id, host[:8])
            occupied[host] += 1
            free[host] -= 1
            if not free[host]:
                del free[host]
            need -= 1
