"""Telling a starved Ray Data pipeline from a slow one, so a run never waits for blocks in silence.

Ray Data's tasks need CPUs. When the run's workers (or other jobs) hold
every CPU of the cluster, the pipeline starts no task and a rank waiting for
its next block would wait without a word (measured: 0 batches in 10
minutes). `Starvation.check` is called by the feed while a rank waits for a
block: once nothing was produced for `timeout` seconds and no probe in that
time found a whole CPU free, it raises `DataStarvedError` naming the cause
and the `data_cpus` option.

Ray Data's own guard (`DataContext.execution_no_progress_timeout_s`, 30
minutes by default) cannot stand in for this: it counts a consumer that
stopped pulling as no progress, and the feed stops pulling on purpose when
it runs ahead of the ranks; this check runs only while a rank waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ray_elastic.exceptions import DataStarvedError

PROBE_EVERY_S = 1.0  # how often the cluster's free CPUs are read while a rank waits


def free_cpus() -> float:
    """The CPUs of the Ray cluster no task or actor holds now."""
    import ray

    return ray.available_resources().get("CPU", 0.0)


class Starvation:
    """The clock of one feed: when a whole CPU was last seen free (see the module docstring).

    `timeout`: seconds without a block, while a rank waits and no CPU is
    free, before the run fails. `data_cpus`: the run's option, named in the
    error. Thread-safe: every waiting rank's call checks it.
    """

    def __init__(
        self,
        timeout: float,
        data_cpus: int,
        probe: Callable[[], float] = free_cpus,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.data_cpus = data_cpus
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._probed_at = float("-inf")
        self._cpu_free_at = float("-inf")  # the last probe that found a whole CPU free

    def check(self, name: str, waiting_since: float, produced_at: float) -> None:
        """Raise `DataStarvedError` if dataset `name` is starved: call it while a rank waits for a block.

        `waiting_since`: when the rank began to wait; `produced_at`: when the
        dataset's execution last produced a block (both on this clock).
        """
        with self._lock:
            now = self._clock()
            if now - self._probed_at >= PROBE_EVERY_S:
                self._probed_at = now
                if self._probe() >= 1.0:  # a Ray Data task asks for one CPU unless told otherwise
                    self._cpu_free_at = now
            starved_for = now - max(waiting_since, produced_at, self._cpu_free_at)
        if starved_for >= self.timeout:
            raise DataStarvedError(self._message(name, starved_for))

    def _message(self, name: str, starved_for: float) -> str:
        if self.data_cpus == 0:
            cause = (
                "with data_cpus=0 the run's workers may take every CPU, and Ray Data's read and map tasks "
                "cannot start: leave data_cpus at its default (1), or more for a pipeline whose tasks ask for more"
            )
        else:
            cause = (
                f"the {self.data_cpus} CPU(s) the workers leave free (data_cpus={self.data_cpus}) are taken by "
                "other tasks or actors, or the pipeline asks for more: raise data_cpus"
            )
        return (
            f"Ray Data produced no block of dataset {name!r} for {starved_for:.0f} s while the cluster had no free "
            f"CPU: {cause}. If a single task of the pipeline legitimately runs this long, or the cluster is "
            f"scaling up, raise data_starvation_timeout (now {self.timeout:g} s)."
        )
