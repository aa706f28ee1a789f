"""Telling a starved Ray Data pipeline from a slow one, so a run never waits for blocks in silence.

Ray Data's tasks need CPUs. When the run's workers (or other jobs) hold
every CPU of the cluster, the pipeline starts no task and a rank waiting for
its next block would wait without a word. `Starvation.check` is called by
the feed while a rank waits for a block: once nothing was produced for
`timeout` seconds and every probe in that time found no whole CPU free,
tasks waiting for one, and none of the job's tasks running, it raises
`DataStarvedError` naming the cause and the `data_cpus` option. No CPU
free alone is no evidence: a data-bound pipeline keeps the CPU it was left
busy with its own task (and Ray Data queues its next tasks behind it), and
a block that takes long is slow, not starved (the feed reports it as
`data_slow`).

Ray Data's own guard (`DataContext.execution_no_progress_timeout_s`, 30
minutes by default) cannot stand in for this: it counts a consumer that
stopped pulling as no progress, and the feed stops pulling on purpose when
it runs ahead of the ranks; this check runs only while a rank waits.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, NamedTuple

from ray_elastic import ray_private
from ray_elastic.exceptions import DataStarvedError

if TYPE_CHECKING:
    from collections.abc import Callable

PROBE_EVERY_S = 1.0  # how often the cluster's free CPUs are read while a rank waits


class Probe(NamedTuple):
    """One look at the cluster while a rank waits for a block."""

    free_cpus: float  # CPUs no task or actor holds
    waiting_cpus: float  # CPUs that tasks and actors waiting to be scheduled ask for
    running_tasks: int | None  # the job's tasks (Ray Data's reads and maps) executing now; None: unknown

    @property
    def fed(self) -> bool:
        """Whether the pipeline can run: a CPU is free, no task waits for one, or one of its tasks runs."""
        return self.free_cpus >= 1.0 or self.waiting_cpus <= 0 or bool(self.running_tasks)


def probe_cluster(since_ms: float = 0.0) -> Probe:
    """Look at the cluster from the feed actor: free CPUs, the demand the GCS gathers, the job's running tasks.

    The demand is what `ray status` shows, gathered from every node whether
    or not an autoscaler runs. The running tasks (`running_tasks`) are
    asked only when the first two do not decide.
    """
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status

    free = ray.available_resources().get("CPU", 0.0)
    demands = get_cluster_status(ray.get_runtime_context().gcs_address).resource_demands.ray_task_actor_demand
    waiting = sum(b.bundle.get("CPU", 0.0) * b.count for demand in demands for b in demand.bundles_by_count)
    running = running_tasks(since_ms) if free < 1.0 and waiting > 0 else None
    return Probe(free, waiting, running)


def running_tasks(since_ms: float = 0.0) -> int | None:
    """How many of this job's tasks run now, from Ray's state API (the dashboard); None where it does not answer.

    Only tasks created at or after `since_ms` (ms since the epoch: when the
    feed started) count: the job may be a long-lived process (a notebook, a
    test session) whose earlier tasks the state API can still list as
    running after their worker died, and one such record would hide the
    starvation for as long as it is kept. The state API is asked at this
    cluster's own dashboard (`ray_private.dashboard_url`): given no address,
    it looks for a cluster on the machine instead, and on one where other
    clusters ran (the test session's) it found a stopped one's GCS and
    waited 40 s for it at every probe before giving up.
    """
    import ray

    try:
        from ray.util.state import list_tasks

        dashboard = ray_private.dashboard_url()
        if dashboard is None:
            return None
        filters = [("job_id", "=", ray.get_runtime_context().get_job_id()), ("state", "=", "RUNNING")]
        # detail: without it the state API leaves creation_time_ms out (None), and no task would count
        tasks = list_tasks(
            dashboard,
            filters=filters,
            limit=100,
            timeout=PROBE_EVERY_S * 5,
            detail=True,
            raise_on_missing_output=False,
        )
    except Exception:  # noqa: BLE001 - the dashboard does not answer: the free CPUs and the demand decide
        return None
    return sum(1 for t in tasks if t.type == "NORMAL_TASK" and (t.creation_time_ms or 0) >= since_ms)


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
        probe: Callable[[], Probe] = probe_cluster,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.data_cpus = data_cpus
        self._probe = probe
        self._clock = clock
        self._lock = threading.Lock()
        self._probed_at = float("-inf")
        self._fed_at = float("-inf")  # the last probe that found the pipeline able to run (`Probe.fed`)

    def check(self, name: str, waiting_since: float, produced_at: float) -> None:
        """Raise `DataStarvedError` if dataset `name` is starved: call it while a rank waits for a block.

        `waiting_since`: when the rank began to wait; `produced_at`: when the
        dataset's execution last produced a block (both on this clock).
        """
        with self._lock:
            now = self._clock()
            if now - self._probed_at >= PROBE_EVERY_S:
                self._probed_at = now
                if self._probe().fed:
                    self._fed_at = now
            starved_for = now - max(waiting_since, produced_at, self._fed_at)
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
            f"CPU, tasks waited for one and none of the pipeline's ran: {cause}. If the cluster is scaling up, "
            f"raise data_starvation_timeout (now {self.timeout:g} s)."
        )
