"""Rank 0's `report()` metrics as the driver holds them until `fit()` fetched them.

Kept apart from the membership core: metrics never change who trains. The
trainer polls `status(metrics_since=N)` every half second; that poll both
hands over the reports from index N on and releases the ones before N, so
the driver holds only what the trainer has not fetched yet. If the trainer
stops fetching (a stuck caller), the log keeps the newest `capacity` reports
and counts the ones it dropped, so a long run's driver never grows without
bound.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from ray_elastic import metrics

logger = logging.getLogger(__name__)

_RATE_WINDOW_S = 5.0  # steps per second: rank 0's reports over this many seconds
_RATE_WINDOW_REPORTS = 10_000
CAPACITY = 100_000  # reports held while the trainer does not fetch them


class MetricsLog:
    """The (time, metrics) pairs rank 0 reported, indexed from the run's first report."""

    def __init__(self, run_id: str, capacity: int = CAPACITY) -> None:
        self.run_id = run_id
        self.capacity = capacity
        self._entries: deque[tuple[float, dict[str, Any]]] = deque()
        self._base = 0  # the run-wide index of _entries[0]
        self.dropped = 0  # reports dropped unfetched because the trainer did not fetch them
        self._recent: deque[float] = deque(maxlen=_RATE_WINDOW_REPORTS)

    def add(self, batch: list[tuple[float, dict[str, Any]]]) -> None:
        if not batch:
            return
        self._entries.extend(batch)
        overflow = len(self._entries) - self.capacity
        if overflow > 0:
            for _ in range(overflow):
                self._entries.popleft()
            self._base += overflow
            if not self.dropped:
                logger.warning("fit() is not fetching metrics; keeping the newest %d reports", self.capacity)
            self.dropped += overflow
        # rank 0 reports once per step: its report rate over the last few seconds is the step rate
        self._recent.extend(t for t, _ in batch)
        window = [t for t in self._recent if t >= batch[-1][0] - _RATE_WINDOW_S]
        if len(window) >= 2 and window[-1] > window[0]:
            metrics.steps_per_second(self.run_id, (len(window) - 1) / (window[-1] - window[0]))

    def __getstate__(self) -> dict[str, Any]:
        # the recent report times only give the step rate: a restarted driver measures it afresh
        return {**self.__dict__, "_recent": deque(maxlen=_RATE_WINDOW_REPORTS)}

    def fetch(self, since: int) -> tuple[int, list[tuple[float, dict[str, Any]]]]:
        """Release the reports before `since`; return the index of the first one returned, and them."""
        release = min(max(0, since - self._base), len(self._entries))
        for _ in range(release):
            self._entries.popleft()
        self._base += release
        return self._base, list(self._entries)

    def __len__(self) -> int:
        """Reports received so far in the run (fetched, held or dropped)."""
        return self._base + len(self._entries)
