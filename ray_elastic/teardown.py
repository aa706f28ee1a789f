"""The run's teardown: the one function that removes what a run left in the cluster, whoever finds it over.

A run leaves in Ray its named actors (the driver, the KV actor, the data
feed, the detached workers; `run_footprint.py`), their placement groups, its
share of the autoscaler request (`autoscale.py`) and the driver's snapshot in
the GCS (`driver/shell/snapshot.py`). Two processes find a run over: `fit()`
when it ends (`trainer/driver_watch.cleanup`, once it has stopped the
driver and the KV actor it holds), and a worker that finds the run's driver
dead for good (`worker_actor.py`: `fit()`'s caller died, and Ray killed the
driver with it). Both call `remove_run`.
"""

from __future__ import annotations

import logging

from ray_elastic import autoscale
from ray_elastic.driver.shell import snapshot
from ray_elastic.run_footprint import remove_run_actors, remove_run_placement_groups

logger = logging.getLogger(__name__)


def remove_run(run_id: str, namespace: str, by: str) -> None:
    """Remove run `run_id`'s snapshot, autoscaler share, and its placement groups and actors in `namespace`.

    Each step is tried on its own, a failure logged: the other steps may
    still succeed, and another caller may have done the failed one. What
    needs no actor goes first: a worker calling this lives in one of the
    run's placement groups, and dies when they are removed (as may the
    other workers, each removing the run at the same time). The snapshot is
    deleted again last: `fit()` calls this right after killing a driver
    that may still write one while it dies. `by` names the caller in the log.
    """
    for step in (
        lambda: snapshot.delete(run_id),
        lambda: autoscale.withdraw(run_id),
        lambda: remove_run_placement_groups(namespace),
        lambda: remove_run_actors(namespace),
        lambda: snapshot.delete(run_id),
    ):
        try:
            step()
        except Exception:  # noqa: BLE001 - each step on its own; the others may have done it
            logger.exception("%s: removing run %s from the cluster", by, run_id)
