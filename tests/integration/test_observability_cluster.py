"""What a user watches of a real run: Ray metrics in Prometheus, and the timeline of the run plotted."""

from __future__ import annotations

import re
import time
import urllib.request

import pytest
from conftest import wait_until
from workloads import counting_train_fn

from ray_elastic import ElasticTrainer


def _scrape() -> str:
    import ray

    texts = []
    for node in ray.nodes():
        if not node.get("Alive") or not node.get("MetricsExportPort"):
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        try:
            texts.append(urllib.request.urlopen(url, timeout=5).read().decode())
        except OSError:
            continue
    return "\n".join(texts)


def _series(text: str, name: str, run_id: str) -> list[float]:
    pattern = re.compile(rf'^{name}\{{[^}}]*run_id="{run_id}"[^}}]*\}} (\S+)$', re.MULTILINE)
    return [float(v) for v in pattern.findall(text)]


@pytest.mark.integration
def test_ray_metrics_reach_prometheus_and_the_timeline_plots_a_real_run(cluster, no_leaks, tmp_path):
    fault = {"rank": 1, "step": 30, "action": "sigkill", "marker": str(tmp_path / "fired")}
    result = ElasticTrainer(
        counting_train_fn,
        2,
        4,
        config={"faults": [fault], "steps": 150, "step_time": 0.01},
        cooldown_range=(30, 60),
        verbose=0,
    ).fit()
    assert result.resets >= 1
    run_id = result.run_id

    def exported() -> dict | None:
        text = _scrape()
        got = {
            "world": _series(text, "ray_elastic_world_size", run_id),
            "resets": _series(text, "ray_elastic_resets_total", run_id),
            "recoveries": _series(text, "ray_elastic_recovery_seconds_count", run_id),
            "rate": _series(text, "ray_elastic_steps_per_second", run_id),
            "commits": _series(text, "ray_elastic_commit_seconds_count", run_id),
        }
        return got if all(got.values()) else None

    started = time.monotonic()
    got = wait_until(exported, 60, f"the run's metrics on Ray's Prometheus endpoints (run_id {run_id})", interval=1)
    print(f"metrics visible {time.monotonic() - started:.1f} s after fit() returned: {got}")
    assert got["world"][-1] == 3, "world size after the crash: 4 -> 3"
    assert sum(got["resets"]) == result.resets
    assert sum(got["recoveries"]) >= 1
    assert max(got["rate"]) > 1
    assert sum(got["commits"]) >= 150 // 5, "every worker's commits are timed"

    png = result.plot_timeline(tmp_path / "timeline.png")
    assert png.stat().st_size > 10_000
