"""Graceful changes of membership on a real local cluster: a node added, a node drained with `ray drain-node`
(what Ray's autoscaler v2 and KubeRay do with a cloud's preemption notice) and a host withdrawn by discovery
each change the world without a crash or a rollback. One run goes through all three: each boot of a worker
costs seconds, and the three changes are independent resets of the same run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until
from runs import assert_same_state, fit_in_thread, sizes
from workloads import FileDiscovery, counting_train_fn

from ray_elastic import ElasticTrainer

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


def test_a_node_added_then_drained_then_a_host_withdrawn_each_change_the_world_without_rollback(
    cluster, no_leaks, tmp_path
):
    """One run through the three graceful changes of membership, each its own reset:

    - a node added (discovery lists it): the world grows while the survivors train on;
    - that node drained with a 30 s deadline, as clouds give (a drain without one reads "no deadline",
      tests/unit/test_driver_core.py): its worker leaves and none is started there again,
      although discovery still lists it;
    - a host withdrawn by discovery: its worker leaves.

    None of them rolls anything back.
    """
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps({first: 2, second: 1}))
    at_3, at_4 = tmp_path / "world-of-3", tmp_path / "world-of-4"
    fut = fit_in_thread(
        ElasticTrainer(
            counting_train_fn,
            min_workers=1,
            max_workers=4,
            config={
                "world_signal_file": str(at_3),
                "world_signal": 3,
                "signal_file": str(at_4),  # at every step from step 20 at world 4
                "signal_step": 20,
                "signal_world_size": 4,
                "until_world": 2,  # counted once the world was 4
                "min_steps": 25,
                "extra_steps": 20,
                "deadline_s": 150,
            },
            discovery=FileDiscovery(str(hosts_file)),
            cooldown_range=(60, 60),
            verbose=0,
        )
    )

    def reached(signal: Path, what: str) -> None:
        wait_until(lambda: signal.exists() or fut.done(), 90, what)
        if not signal.exists():  # fit() ended first: its own error says why
            fut.result()
            raise AssertionError(f"fit() returned before {what}")

    node = cluster.add_node(num_cpus=1)
    try:
        reached(at_3, "the run to train at world 3")
        added_at = time.time()
        hosts_file.write_text(json.dumps({first: 2, second: 1, node.node_id: 1}))
        reached(at_4, "the world to grow to 4 on the added node")
        at_3.unlink()  # nobody writes it at world 4: it comes back when the drain brings the world to 3
        drain(cluster.address, node.node_id, 30)
        reached(at_3, "the world to shrink to 3 after the drain")
        hosts_file.write_text(json.dumps({first: 2, node.node_id: 1}))
        result = fut.result(timeout=180)
    finally:
        cluster.remove_node(node)
    assert sizes(result) == [3, 4, 3, 2], "the drained node's worker left; none was started there again"
    steps = [m["step"] for m in result.metrics_history]
    assert steps == list(range(1, len(steps) + 1)), "a graceful change of membership must not roll back"
    history = list(zip(result.metric_times, result.metrics_history, strict=False))
    grown_at = next(t for t, m in history if m["world_size"] == 4)
    during_boot = [m for t, m in history if added_at < t < grown_at]
    assert len(during_boot) >= 10, "the survivors kept training while the newcomer booted"
    kinds = [e.kind for e in result.events]
    assert kinds == ["start", "hosts_added", "preempted", "hosts_removed"], kinds
    added, preempted, removed = result.events[1:]
    assert added.world_size == 4 and added.reset_duration is not None
    assert preempted.detail.startswith(f"preempted: node {node.node_id[:8]} is draining"), preempted.detail
    assert "deadline in" in preempted.detail
    assert preempted.world_size == 3 and preempted.reset_duration is not None
    assert removed.world_size == 2
    assert_same_state(result)
