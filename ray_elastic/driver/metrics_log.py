"""Rank 0's `report()` metrics as the driver keeps them, and the steps/s gauge read off them.

Kept apart from the membership core: metrics never change who trains.
"""

from __future__ import annotations

from typing import Any

from ray_elastic import metrics

_RATE_WINDOW_S = 5.0  # steps per second: rank 0's reports over this many seconds
_RATE_WINDOW_REPORTS = 10_000


class MetricsLog:
    """The (time, metrics) pairs rank 0 reported, in order."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._entries: list[tuple[float, dict[str, Any]]] = []

    def add(self, batch: list[tuple[float, dict[str, Any]]]) -> None:
        if not batch:
            return
        self._entries.extend(batch)
        # rank 0 reports once per step: its report rate over the last few seconds is the step rate
        recent = [t for t, _ in self._entries[-_RATE_WINDOW_REPORTS:] if t >= batch[-1][0] - _RATE_WINDOW_S]
        if len(recent) >= 2 and recent[-1] > recent[0]:
            metrics.steps_per_second(self.run_id, (len(recent) - 1) / (recent[-1] - recent[0]))

    def since(self, index: int) -> list[tuple[float, dict[str, Any]]]:
        return self._entries[index:]

    def all(self) -> list[tuple[float, dict[str, Any]]]:
        return self._entries

    def __len__(self) -> int:
        return len(self._entries)
