"""The driver's phase: where the run is, the moves allowed between phases, and why each move was made.

The phases are `protocol.DriverState` (`fit()` reads them in the driver's
status, so the enum lives with the protocol types):

- WAITING: fewer than `min_workers` ready; the run starts here, and fails
  once it has waited longer than `elastic_timeout` (`since` says how long);
- RUNNING: a generation trains (generation 1 while its ranks still sync too:
  there is nothing to reset from);
- RESETTING: a generation after the first is published and some of its ranks
  still sync;
- DONE and FAILED: final; nothing moves out of them.

`RunPhase.move` is the only function that changes the phase. The core's
parts call it where they decide (generations publish, wait and sync;
finishing ends the run; any part may fail it), each with the reason for the
move, and the newest `HISTORY` moves are kept with their reasons: the
snapshot holds them, and `DriverCore.phase_changes()` reads them for
debugging. The first ending wins: nothing moves out of DONE or FAILED.
Any other move the table does not allow is a bug in the core: `PhaseError`.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from ray_elastic.protocol import DriverState

if TYPE_CHECKING:
    from collections.abc import Mapping

WAITING, RUNNING, RESETTING, DONE, FAILED = (
    DriverState.WAITING,
    DriverState.RUNNING,
    DriverState.RESETTING,
    DriverState.DONE,
    DriverState.FAILED,
)

# from each phase, the phases a move may reach; a live run may always end, done or failed
MOVES: Mapping[DriverState, frozenset[DriverState]] = {
    # generation 1 (or a generation after a durable restart) published; or the current one whole again
    WAITING: frozenset({RUNNING, RESETTING, DONE, FAILED}),
    # too few workers (or every member lost, resuming from the durable checkpoint); a new generation published
    RUNNING: frozenset({WAITING, RESETTING, DONE, FAILED}),
    # the last member synced; too few workers; a newer generation published before the last member synced
    RESETTING: frozenset({WAITING, RUNNING, RESETTING, DONE, FAILED}),
    DONE: frozenset(),
    FAILED: frozenset(),
}


class PhaseError(RuntimeError):
    """A move `MOVES` does not allow: the core's bookkeeping is wrong, and the run must not go on on it."""


class PhaseChange(NamedTuple):
    """One move: when (wall clock, as events' times), from which phase to which, and why."""

    at: float
    before: DriverState
    after: DriverState
    reason: str


class RunPhase:
    """The run's phase, the time it was entered, and its newest `HISTORY` moves."""

    HISTORY = 32

    def __init__(self, started_at: float, wall_offset: float) -> None:
        """`started_at`: the shell's monotonic time the run started (waiting); `wall_offset` turns it into wall time."""
        self._wall_offset = wall_offset
        self._current = WAITING
        self._since = started_at
        self._history: deque[PhaseChange] = deque(
            [PhaseChange(started_at + wall_offset, WAITING, WAITING, "the run started")], maxlen=self.HISTORY
        )

    @property
    def current(self) -> DriverState:
        return self._current

    @property
    def since(self) -> float:
        """The shell's monotonic time the current phase was entered."""
        return self._since

    @property
    def is_final(self) -> bool:
        return self._current.is_final

    def history(self) -> list[PhaseChange]:
        """The newest moves, oldest first (the run's start the first, until it is pushed out)."""
        return list(self._history)

    def move(self, to: DriverState, reason: str, now: float) -> None:
        """Enter `to` at `now` (the shell's monotonic clock) for `reason`; `PhaseError` if `MOVES` forbids it.

        A run that ended stays as it ended (the first ending wins): a move out
        of DONE or FAILED is ignored, as what the core still tidies up in the
        batch that ended the run changes nothing.
        """
        if self._current.is_final:
            return
        if to not in MOVES[self._current]:
            raise PhaseError(f"the driver cannot move from {self._current.value} to {to.value} ({reason})")
        self._history.append(PhaseChange(now + self._wall_offset, self._current, to, reason))
        self._current = to
        self._since = now
