"""The run's membership events as the driver holds them: the newest `capacity`, numbered from the run's first.

`Result.events` and the progress display read them. A run that goes on for
weeks with churn would otherwise hold every event it ever had, send all of
them to `fit()` on every status poll, and scan all of them at every sync.
So the log keeps the newest `capacity` events (counting the ones it let go)
and hands `fit()` only the events it has not seen, plus those still waiting
for their reset to end (their `reset_duration` is filled in later).

An event waits for the generation that absorbs it to sync. When a newer
generation replaces that one before it synced (a death during the first
sync), the event's reset ends with the newer one's: `open_events` hands it
over then, so no event waits for ever (the start event's line included).
"""

from __future__ import annotations

import logging
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ray_elastic.events import Event

logger = logging.getLogger(__name__)

CAPACITY = 10_000  # events kept: a reset a minute for a week


class EventLog:
    """Events in the order they happened; index 0 is the oldest one kept."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._events: deque[Event] = deque()
        self.dropped = 0  # events let go: the run-wide number of `self[0]`
        self._open = 0  # run-wide number of the oldest event that may still wait for its reset to end

    def append(self, event: Event) -> None:
        self._events.append(event)
        if len(self._events) > self.capacity:
            self._events.popleft()
            if not self.dropped:
                logger.warning(
                    "over %d membership events: Result.events keeps the newest %d", self.capacity, self.capacity
                )
            self.dropped += 1

    def of_generation(self, generation: int) -> list[Event]:
        """The events `generation` absorbed, oldest first: read from the newest back (they come in generation order)."""
        found = []
        for ev in reversed(self._events):
            if ev.generation < generation:
                break
            if ev.generation == generation:
                found.append(ev)
        return found[::-1]

    def open_events(self, generation: int) -> list[Event]:
        """The events of `generation` or older whose reset has not ended, oldest first: its sync ends them."""
        start = self._skip_settled()
        return [e for e in islice(self._events, start, None) if e.reset_duration is None and e.generation <= generation]

    def since(self, seen: int) -> tuple[int, list[Event]]:
        """The events from run-wide number `seen` on, and every older one whose reset has not ended yet.

        Returns the run-wide number of the first event returned, and the events.
        """
        first = max(min(seen, self._skip_settled() + self.dropped), self.dropped)
        return first, list(islice(self._events, first - self.dropped, None))

    def _skip_settled(self) -> int:
        """The index of the oldest event whose reset may not have ended (len(self) if none)."""
        i = max(self._open - self.dropped, 0)
        while i < len(self._events) and self._events[i].reset_duration is not None:
            i += 1
        self._open = i + self.dropped
        return i

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, index: int) -> Event:
        return self._events[index]
