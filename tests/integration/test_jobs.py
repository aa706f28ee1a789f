"""Ray Jobs: `ray job submit --working-dir . -- python examples/job.py` on a `ray start --head` cluster.

The cluster has Ray's token authentication on; the test submits as a user
does, with `RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN` in the environment, and
reads the job's streamed logs for the elastic events: the start, a worker
SIGKILLed mid-training and the recovery from it, and the result.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.integration


def test_job_submit_without_the_token_is_refused(ray_start_cluster):
    env = {**ray_start_cluster.env, "RAY_AUTH_TOKEN": "0" * 64}
    proc = ray_start_cluster.run(["ray", "job", "list", "--address", ray_start_cluster.dashboard_url], 60, env=env)
    assert proc.returncode != 0
    assert "Invalid authentication token" in proc.stdout + proc.stderr


def test_submitted_job_trains_through_a_worker_crash(ray_start_cluster):
    proc = ray_start_cluster.run(
        [
            "ray", "job", "submit",
            "--address", ray_start_cluster.dashboard_url,
            "--working-dir", ".",
            "--", "python", "examples/job.py", "--epochs", "1", "--crash-at-step", "15",
        ],
        timeout=240,
    )  # fmt: skip
    logs = proc.stdout + proc.stderr
    print(logs[-3000:])  # shown with pytest -s: what `ray job submit` printed
    assert proc.returncode == 0, logs[-5000:]
    assert re.search(r"Job 'raysubmit_\w+' succeeded", logs), logs[-3000:]
    assert "[ray-elastic] started with 3 workers" in logs, logs[-3000:]
    recovered = re.search(r"\[ray-elastic\] worker .* died.*recovered in ([\d.]+) s", logs)
    assert recovered, logs[-3000:]
    assert float(recovered.group(1)) < 5.0
    assert "events: [('start', 3), ('worker_failed', 2)" in logs, logs[-3000:]
    accuracy = re.search(r"test accuracy ([\d.]+) after \d+ steps", logs)
    assert accuracy and float(accuracy.group(1)) > 0.8, logs[-3000:]
