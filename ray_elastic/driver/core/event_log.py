"""The run's membership events as the driver holds them: the newest `capacity`, numbered from the run's first.

`Result.events` and the progress display read them. A run that goes on for
weeks with churn would otherwise hold every event it ever had, send all of
them to `fit()` on every status poll, and scan all of them at every sync.
So the log keeps the newest `capacity` events (counting the ones it let go)
and hands `fit()` only the events it has not seen, plus those still waiting
for their reset to end (their `reset_duration` is filled in later).
"""

from __future__ import annotations

import logging
from collections import deque
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

    def since(self, seen: int) -> tuple[int, list[Event]]:
        """The events from run-wide number `seen` on, and any older one whose reset has not ended yet.

        Returns the run-wide number of the first event returned, and the events.
        """
        first = max(seen, self.dropped)
        for number in range(min(first, self.dropped + len(self._events)) - 1, self.dropped - 1, -1):
            if self._events[number - self.dropped].reset_duration is not None:
                break
            first = number
        return first, [self._events[i] for i in range(first - self.dropped, len(self._events))]

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def __getitem__(self, index: int) -> Event:
        return self._events[index]
