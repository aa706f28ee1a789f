"""Ray metrics of a run, on Ray's Prometheus endpoint (and so in Grafana).

Ray exports them from every node's metrics agent (the ports Ray lists for
Prometheus' service discovery), with the `ray_` prefix Ray adds:

| name | kind | recorded by |
|---|---|---|
| `ray_elastic_world_size` | gauge | the driver, at every new generation |
| `ray_elastic_resets_total` | counter | the driver, at every reset |
| `ray_elastic_recovery_seconds` | histogram | the driver: change -> last rank synced |
| `ray_elastic_steps_per_second` | gauge | the driver, from rank 0's `report()` rate |
| `ray_elastic_commit_seconds` | histogram | every worker, per `commit()` |

Every series carries the run's id as the `run_id` tag, so concurrent runs stay apart.
Recording never raises: a metric that cannot be exported must not stop training.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)

_RECOVERY_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_COMMIT_BOUNDARIES = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5]


@cache
def _metrics() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge, Histogram

    tags = ("run_id",)
    return {
        "world_size": Gauge("elastic_world_size", "Workers in the current generation", tag_keys=tags),
        "resets": Counter("elastic_resets_total", "Generations formed after the first", tag_keys=tags),
        "recovery": Histogram(
            "elastic_recovery_seconds",
            "Seconds from a membership change to the last rank finishing its sync",
            boundaries=_RECOVERY_BOUNDARIES,
            tag_keys=tags,
        ),
        "steps_per_second": Gauge(
            "elastic_steps_per_second", "Rank 0's report() calls per second (one per step)", tag_keys=tags
        ),
        "commit": Histogram(
            "elastic_commit_seconds",
            "Seconds one commit() spent saving the state",
            boundaries=_COMMIT_BOUNDARIES,
            tag_keys=tags,
        ),
    }


def _record(name: str, method: str, value: float, run_id: str) -> None:
    try:
        getattr(_metrics()[name], method)(value, tags={"run_id": run_id})
    except Exception as e:  # noqa: BLE001 - metrics are best effort
        logger.debug("metric %s not recorded: %s", name, e)


def world_size(run_id: str, size: int) -> None:
    _record("world_size", "set", size, run_id)


def reset(run_id: str) -> None:
    _record("resets", "inc", 1, run_id)


def recovery(run_id: str, seconds: float) -> None:
    _record("recovery", "observe", seconds, run_id)


def steps_per_second(run_id: str, rate: float) -> None:
    _record("steps_per_second", "set", rate, run_id)


def commit(run_id: str, seconds: float) -> None:
    _record("commit", "observe", seconds, run_id)
