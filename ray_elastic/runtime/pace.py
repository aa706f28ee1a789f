"""This rank's pace: its own compute per step, and how long it waits in the step's gradient collectives.

In synchronous data parallelism every step waits for the slowest rank, so
the step time says nothing about who is slow. What a rank does alone does:

- compute: from the end of one step's gradient collectives to the next
  step's first gradient launch (optimizer step, data, forward, backward);
- wait: the time it blocks on the step's gradient collectives. The slowest
  rank arrives last and waits only for the network; the others wait for it
  as well. So the waits say who waits for whom.

Work the framework gives one rank and not the others (rank 0 copying a
commit for the checkpoint writer, or blocking in the writer until the
previous write ends) is marked `aside()` and left out of that rank's
compute: the ranks are compared on the same work.

The torch helpers mark the two moments (`DistributedOptimizer` at its first
bucket launch and at the end of `synchronize()`; `prepare_model`'s process
group at a backward's first allreduce and in autograd's final callback).
Each mark is two clock reads and a few additions (about a microsecond), so
measuring slows no one. Every `PACE_INTERVAL_S` of training (and at least one
step) the meter closes a `PaceSummary` and hands it to its sink, the
worker's `MetricsShipper`, which ships it in the metrics batches it already
sends (no call of its own, no collective). The driver's straggler policy
(`driver/core/stragglers.py`) reads the summaries.

This module imports nothing of the package but the protocol types (`PaceSummary`): the torch
helpers mark it, the runtime sets its sink (as `collective/activity.py` for the activity marks).
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ray_elastic.protocol import PACE_INTERVAL_S, PaceSummary

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


class PaceMeter:
    """Marks of this process's gradient steps, summed per interval.

    Args:
        interval_s: the span of one summary (`PACE_INTERVAL_S`).
        clock: a monotonic clock for the spans (`time.perf_counter`).
        wall: the clock the summaries are stamped with (`time.time`).
    """

    def __init__(
        self,
        interval_s: float = PACE_INTERVAL_S,
        clock: Callable[[], float] = time.perf_counter,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._wall = wall
        self.sink: Callable[[PaceSummary], None] | None = None  # the worker's shipper; None: summaries are dropped
        self._restart(-1)

    def _restart(self, generation: int) -> None:
        """A new ring: what the old one measured is not carried over (a reset's sync is no step)."""
        self._generation = generation
        self._started = self._clock()
        self._started_wall = self._wall()
        self._reduced_at: float | None = None  # the end of the last step's collectives: compute starts there
        self._launched = False
        self._steps = 0
        self._compute = 0.0
        self._wait = 0.0
        self._step_wait = 0.0  # the current step's, counted with it
        self._step_aside = 0.0  # the framework's work inside the current step's compute, left out of it
        self._aside = 0.0  # the interval's
        self._computes: list[float] = []  # each counted step's compute, for the interval's median

    def launched(self, generation: int) -> None:
        """The step's first gradient collective starts: this rank's compute of the step ends."""
        if generation != self._generation:
            self._restart(generation)
        if self._launched:  # a second launch in one step (e.g. a bucket launched late): the first one counts
            return
        self._launched = True
        if self._reduced_at is not None:
            compute = max(0.0, self._clock() - self._reduced_at - self._step_aside)
            self._compute += compute
            self._computes.append(compute)
        self._step_aside = 0.0

    @contextmanager
    def aside(self) -> Iterator[None]:
        """The framework's own work on this rank, done between steps: not counted as its compute."""
        started = self._clock()
        try:
            yield
        finally:
            spent = self._clock() - started
            self._step_aside += spent
            self._aside += spent

    def waited(self, seconds: float) -> None:
        """This rank blocked `seconds` on the step's gradient collectives."""
        self._step_wait += seconds

    def reduced(self, generation: int) -> None:
        """The step's gradient collectives ended: one step counted; its compute starts from now."""
        if generation != self._generation:
            self._restart(generation)  # nothing launched in this ring yet: the step is not counted
        now = self._clock()
        if self._launched and self._reduced_at is not None:
            self._steps += 1  # a step whose compute was measured (the ring's first step has no start)
            self._wait += self._step_wait
        self._step_wait = 0.0
        self._step_aside = 0.0
        self._launched = False
        self._reduced_at = now
        if self._steps and now - self._started >= self.interval_s:
            self._close(now)

    def _close(self, now: float) -> None:
        summary = PaceSummary(
            generation=self._generation,
            start=self._started_wall,
            end=self._started_wall + (now - self._started),
            steps=self._steps,
            compute_s=self._compute,
            wait_s=self._wait,
            typical_s=statistics.median(self._computes) if self._computes else None,
            aside_s=self._aside,
        )
        self._started, self._started_wall = now, summary.end
        self._steps, self._compute, self._wait, self._aside = 0, 0.0, 0.0, 0.0
        self._computes = []
        if self.sink is not None:
            self.sink(summary)


PACE = PaceMeter()  # this process's
