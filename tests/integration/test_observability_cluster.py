"""What a user watches of a real run: Ray metrics in Prometheus, and the timeline of the run plotted."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from conftest import wait_until
from runs import assert_same_state, sizes
from workloads import FileDiscovery, counting_train_fn

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
    """Also the fault matrix's cell "a failure inside a commit rolls back to that commit" (test_faults.py):
    rank 1 dies inside the commit of step 20, and no newcomer takes its place (3 -> 2)."""
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({first: 2, second: 1}))  # every slot taken: the victim's is not refilled
    fault = {"rank": 1, "step": 20, "action": "sigkill", "phase": "commit", "marker": str(tmp_path / "fired")}
    result = ElasticTrainer(
        counting_train_fn,
        2,
        3,
        config={"faults": [fault], "steps": 150, "step_time": 0.01},
        discovery=FileDiscovery(str(hosts)),
        cooldown_range=(60, 60),
        verbose=0,
    ).fit()
    assert sizes(result) == [3, 2]
    # the victim died inside the commit of step 20; the survivors had finished theirs and resume after it
    first_after = next(m for m in result.metrics_history if m["world_size"] == 2)
    assert first_after["step"] == 21
    assert_same_state(result)
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
    assert got["world"][-1] == 2, "world size after the crash: 3 -> 2"
    assert sum(got["resets"]) == result.resets
    assert sum(got["recoveries"]) >= 1
    assert max(got["rate"]) > 1
    assert sum(got["commits"]) >= 150 // 5, "every worker's commits are timed"

    png = result.plot_timeline(tmp_path / "timeline.png")
    assert png.stat().st_size > 10_000
