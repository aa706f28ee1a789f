"""One real `ray-elastic run`: the installed command against a `ray start --head` cluster, with a
discovery script that offers fewer slots than the cluster has, so the world size shows that the script
was obeyed.
"""

from __future__ import annotations

import os
import re
import stat

import pytest
from conftest import wait_until
from ray_start import VENV_BIN

CLI = os.path.join(VENV_BIN, "ray-elastic")


def test_run_with_a_discovery_script(ray_start_cluster, tmp_path):
    (node,) = wait_until(lambda: ray_start_cluster.list_state("nodes"), 120, "the cluster's node in the state API")
    discover = tmp_path / "discover.sh"
    # two slots on the one node, though its 3 CPUs hold three workers: the script decides
    discover.write_text(f"#!/bin/sh\necho {node['node_ip']}:2\n")
    discover.chmod(discover.stat().st_mode | stat.S_IXUSR)
    proc = ray_start_cluster.run(
        [
            CLI, "run", "examples/linear_regression.py:train_fn",
            "--min-workers", "2", "--max-workers", "3",
            "--discovery-script", str(discover),
            "--resources-per-worker", "CPU=1",
            "--config", "steps=40", "lr=0.05", "commit_every=10",
            "--address", ray_start_cluster.address,
        ],
        timeout=180,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "[ray-elastic] started with 2 workers" in out, out[-3000:]
    assert re.search(r"^ray-elastic: finished in [\d.]+ s with 0 reset\(s\)$", proc.stdout, re.MULTILINE), out
    assert re.search(r"^  start\s+world size 2 ", proc.stdout, re.MULTILINE), out
    assert re.search(r"^last metrics \(40 reported\): \{.*'step': 40, 'world_size': 2\}$", proc.stdout, re.M), out
    # config values arrive parsed: 40 an int (the loop stopped at it), the weights learned with lr 0.05
    returned = re.search(r"^return value: \{'steps': 40, 'w': \[([-\d., ]+)\], 'world_size': 2\}$", proc.stdout, re.M)
    assert returned, out
    learned = [float(v) for v in returned.group(1).split(",")]
    assert learned == pytest.approx([2.0, -3.0, 0.5, 1.0], abs=0.2)
