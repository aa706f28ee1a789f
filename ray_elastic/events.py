"""Membership events as `Result.events` lists them."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Event:
    """One membership change.

    `time` is seconds since the epoch; `world_size` the size of the
    generation that absorbed the change, `previous_world_size` the size before
    it; `reset_duration` the seconds from the change to the last rank
    finishing its sync in that generation (0.0 for what paused no training;
    None while that sync goes on, or if training ended first). The kinds
    are `protocol.EventKind`'s; docs/events-and-errors.md says
    when each happens.
    """

    time: float
    kind: str
    world_size: int
    generation: int
    reset_duration: float | None = None
    detail: str = ""
    previous_world_size: int | None = None

    def to_dict(self) -> dict:
        """Plain values only: `kind` as its string, so users' prints and comparisons see "start", not an enum."""
        out = asdict(self)
        out["kind"] = str(self.kind)
        return out
