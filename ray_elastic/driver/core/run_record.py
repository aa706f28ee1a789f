"""What every part of the driver's core reads and writes: the shared record of one run.

The parts (`generations`, `finishing`, `failures`, `scaling`) each decide
one thing and keep their own bookkeeping; what they all need lives here:
the options, the clock, the workers (`Roster`), the hosts discovery offers
and the nodes draining, the event log, the actions the shell is to carry
out, and the run's phase (`phase.py`: failed or done, and why, among the
others). Nothing here decides.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.event_log import EventLog
from ray_elastic.driver.core.phase import DONE, FAILED, RunPhase
from ray_elastic.driver.core.roster import Roster, WorkerRecord, WorkerStatus
from ray_elastic.driver.core.stragglers import Bench
from ray_elastic.events import Event

if TYPE_CHECKING:
    from ray_elastic.config import RunConfig
    from ray_elastic.protocol import EventKind

logger = logging.getLogger(__name__)


class RunRecord:
    """The run's facts, shared by the core's parts; the actions they ask for, in order."""

    def __init__(self, config: RunConfig, wall_offset: float, started_at: float) -> None:
        """`wall_offset` turns the shell's monotonic `now` into wall-clock event times; `started_at` is monotonic."""
        self.config = config
        self.wall_offset = wall_offset
        self.started_at = started_at
        self.roster = Roster()
        self.hosts: dict[str, int] = {}  # discovery's view: host -> slots
        self.draining: dict[str, float] = {}  # node -> wall-clock deadline (0: none); no worker may stay or start there
        self.benched = Bench()  # stragglers' slots (or whole nodes) cooling down: no worker may start there
        self.evicted: set[str] = set()  # stragglers let go, until the generation that leaves them out is published
        self.events = EventLog()
        self.now = started_at  # the time of the batch being applied (the shell's monotonic clock)
        self.phase = RunPhase(started_at, wall_offset)
        self.failure: str | None = None
        self.actions: list[m.Action] = []

    def act(self, action: m.Action) -> None:
        self.actions.append(action)

    def take_actions(self) -> list[m.Action]:
        actions, self.actions = self.actions, []
        return actions

    def fail(self, reason: str) -> None:
        """The run ends failed with `reason` (the first reason given wins: a run already ended stays as it is)."""
        if not self.phase.is_final:
            logger.error("run failed: %s", reason)
            self.failure = reason
            self.phase.move(FAILED, reason, self.now)

    def done(self, reason: str) -> None:
        """The run ends done, for `reason` (unless it ended already)."""
        if not self.phase.is_final:
            self.phase.move(DONE, reason, self.now)

    def let_go(self, rec: WorkerRecord, reason: str) -> None:
        """Stop a worker that is not needed (left out, or the run is finishing); nothing it says counts any more."""
        self.act(m.Kill(rec.worker_id))
        self.roster.fenced.add(rec.worker_id)
        self.roster.move(rec, WorkerStatus.GONE, f"let go: {reason}")

    def event(self, kind: EventKind, detail: str, now: float, world_size: int, generation: int) -> Event:
        return Event(
            time=now + self.wall_offset, kind=kind, world_size=world_size, generation=generation, detail=detail
        )
