"""Preemption notices on a real local cluster: a node drained with `ray drain-node` (what Ray's autoscaler
v2 and KubeRay do with a cloud's notice) is a graceful removal, never a crash."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from runs import assert_same_state, sizes, start_and_reach_step

pytestmark = pytest.mark.integration

RAY_CLI = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"


def drain(address: str, node_id: str, deadline_s: int | None) -> None:
    command = [
        RAY_CLI,
        "drain-node",
        "--address",
        address,
        "--node-id",
        node_id,
        "--reason",
        "DRAIN_NODE_REASON_PREEMPTION",
        "--reason-message",
        "spot instance reclaimed (test)",
    ]
    if deadline_s is not None:
        command += ["--deadline-remaining-seconds", str(deadline_s)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_drained_nodes_workers_leave_gracefully_and_are_not_replaced_there(cluster, no_leaks, tmp_path):
    """A 30 s deadline, as clouds give; a drain without one reads "no deadline" (tests/unit/test_driver_core.py)."""
    deadline_s = 30
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        fut = start_and_reach_step(
            tmp_path,
            min_workers=2,
            max_workers=6,
            config={"until_world": 4, "min_steps": 25, "extra_steps": 40, "deadline_s": 150},
        )
        drain(cluster.address, node.node_id, deadline_s)
        result = fut.result(timeout=180)
    finally:
        cluster.remove_node(node)
    assert sizes(result) == [6, 4], "the drained node's workers left; none was started there again"
    steps = [m["step"] for m in result.metrics_history]
    assert steps == list(range(1, len(steps) + 1)), "a preemption notice must not roll anything back"
    kinds = [e.kind for e in result.events]
    assert kinds == ["start", "preempted"], kinds
    preempted = result.events[1]
    assert preempted.detail.startswith(f"preempted: node {node.node_id[:8]} is draining")
    assert "deadline in" in preempted.detail
    assert preempted.world_size == 4 and preempted.reset_duration is not None
    assert_same_state(result)
