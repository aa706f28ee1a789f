"""End to end on a real local multi-node Ray cluster: the elastic behaviours.

Each test runs `ElasticTrainer.fit()` on the session's cluster (2 nodes x 2
CPUs) with `counting_train_fn`, injects a fault or changes the cluster, and
reads what happened from the `Result`: rank 0's per-step metrics tell the
world size at each step and whether steps were redone; the returned digests
tell whether all ranks ended with bitwise-equal state.

Elsewhere, each in one run that goes through several of these behaviours: a
SIGKILL recovering from the last commit and refilling the slot, rank 0's
death and reset callbacks (test_sync_integration.py); a node added, drained
and withdrawn (test_preemption.py); the autoscaler's request for missing
slots (test_robustness.py's concurrent runs).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
from conftest import actor_pid, run_namespaces_alive, wait_until
from runs import assert_same_state, fault, sizes, start_and_reach_step
from workloads import FileDiscovery, counting_train_fn

import ray_elastic as elastic
from ray_elastic import ElasticTrainer, TrainingFailedError

pytestmark = pytest.mark.integration


def first_after(result, since: float):
    return next((t, m) for t, m in zip(result.metric_times, result.metrics_history, strict=False) if t > since)


def test_ray_kill_and_a_hung_worker_are_each_lost_and_training_goes_on(cluster, no_leaks, tmp_path):
    """One run, two losses: `ray.kill` of w4, then w3 SIGSTOPped (hung) and killed by the liveness check."""
    world_of_3 = tmp_path / "world-of-3"
    fut = start_and_reach_step(
        tmp_path,
        min_workers=2,
        max_workers=4,
        config={
            "until_world": 2,
            "min_steps": 21,
            "extra_steps": 20,
            "world_signal_file": str(world_of_3),
            "world_signal": 3,
        },
        liveness_timeout=2,
        cooldown_range=(60, 60),  # keep the slots empty: the run ends at world size 2
    )
    namespace = next(a["namespace"] for a in run_namespaces_alive() if a["name"] == "w4")
    killed_at = time.time()
    ray.kill(ray.get_actor("w4", namespace=namespace))
    wait_until(world_of_3.exists, 60, "the world to train at 3 after ray.kill of w4")
    os.kill(actor_pid("w3", namespace), signal.SIGSTOP)
    result = fut.result(timeout=120)
    assert sizes(result) == [4, 3, 2]
    assert result.return_value["world_size"] == 2
    assert [e.kind for e in result.events] == ["start", "worker_failed", "worker_failed"], result.events
    # ray.kill: the survivors' first step after the reset is at world 3
    t, m = first_after(result, killed_at + result.events[1].reset_duration)
    assert m["world_size"] == 3
    # the hung worker was found by the liveness check
    assert "w3" in result.events[2].detail, result.events[2].detail
    assert_same_state(result)


def test_all_workers_failing_is_a_clear_error_that_says_how_to_resume(cluster, no_leaks, tmp_path):
    """Every worker SIGKILLed and no `checkpoint_dir`: the error says who was lost and how to resume."""
    faults = [fault(tmp_path, rank=r, step=10) for r in range(2)]
    started = time.monotonic()
    with pytest.raises(
        TrainingFailedError,
        match=r"all \d+ workers of generation \d+ were lost \(w\d+(, w\d+)*\); no survivor holds the training state",
    ) as info:
        ElasticTrainer(counting_train_fn, 2, 2, config={"faults": faults, "steps": 100}, verbose=0).fit()
    assert "configure checkpoint_dir to resume" in str(info.value)
    assert time.monotonic() - started < 60


def test_min_workers_never_reached_fails_within_elastic_timeout(cluster, no_leaks):
    """Discovery every 0.1 s keeps the driver's queue busy: the deadline must hold whatever the message rate
    (every other test runs at the default interval of 1 s)."""
    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match=r"min_workers=5 not reached within elastic_timeout=5 s"):
        ElasticTrainer(
            counting_train_fn,
            5,
            5,
            config={"steps": 10},
            elastic_timeout=5,
            discovery_interval=0.1,
            verbose=0,
        ).fit()
    assert time.monotonic() - started < 5 + 30


def test_reset_limit_exceeded_fails(cluster, no_leaks, tmp_path):
    f = fault(tmp_path, rank=1, step=12)
    with pytest.raises(TrainingFailedError, match="reset_limit=0 reached"):
        ElasticTrainer(counting_train_fn, 1, 2, config={"faults": [f], "steps": 200}, reset_limit=0, verbose=0).fit()


def test_user_exception_fails_fast_with_its_traceback(cluster, no_leaks, tmp_path):
    f = fault(tmp_path, rank=1, step=5, action="raise")
    with pytest.raises(TrainingFailedError) as info:
        ElasticTrainer(counting_train_fn, 2, 2, config={"faults": [f], "steps": 10**6}, verbose=0).fit()
    message = str(info.value)
    assert "ValueError: user code failed on purpose at step 5" in message
    assert "_fire_faults" in message  # the user's own traceback, not a wrapper's
    assert "rank 1" in message


def test_fit_returns_rank0_value_and_metrics_in_order(cluster, no_leaks):
    result = ElasticTrainer(counting_train_fn, 2, 3, config={"steps": 25}, verbose=0).fit()
    assert [m["step"] for m in result.metrics_history] == list(range(1, 26))
    assert result.return_value["steps"] == 25 and result.return_value["world_size"] == 3
    assert result.resets == 0
    assert_same_state(result)


def test_worker_api_outside_a_worker_is_a_clear_error():
    with pytest.raises(RuntimeError, match="only works inside train_fn"):
        elastic.rank()
    with pytest.raises(RuntimeError, match="only works inside train_fn"):
        elastic.report({"loss": 1.0})


def test_single_host_waits_out_its_cooldown_and_refills(cluster, no_leaks, tmp_path):
    """One host, min_workers == its slots: a crash leaves too few, so the run waits for the cool-down."""
    only = cluster.worker_nodes_at_start[0].node_id
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps({only: 2}))
    f = fault(tmp_path, rank=1, step=12)
    result = ElasticTrainer(
        counting_train_fn,
        min_workers=2,
        max_workers=2,
        config={"faults": [f], "steps": 40},
        discovery=FileDiscovery(str(hosts_file)),
        cooldown_range=(1, 5),
        verbose=0,
    ).fit()
    assert sizes(result) == [2]  # never trained below min_workers
    steps = [m["step"] for m in result.metrics_history]
    assert steps[: steps.index(12)] == list(range(1, 12)) and steps[-1] == 40
    assert steps[steps.index(12) + 1] == 11, "after the crash training resumes from the commit at step 10"
    # the crashed slot came back after its cool-down, in the same reset
    assert [(e.kind, e.generation) for e in result.events] == [
        ("start", 1),
        ("worker_failed", 2),
        ("hosts_added", 2),
    ]
    assert_same_state(result)


def test_discovery_failing_on_first_call_fails_at_once(cluster, no_leaks):
    def broken_discovery() -> dict:
        raise ConnectionError("inventory service unreachable")

    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match="inventory service unreachable"):
        ElasticTrainer(counting_train_fn, 2, 4, config={"steps": 5}, discovery=broken_discovery, verbose=0).fit()
    assert time.monotonic() - started < 30


def test_node_lost_its_workers_leave_and_training_goes_on(cluster, no_leaks, tmp_path):
    node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps({first: 1, second: 1, node.node_id: 1}))  # one worker on the node lost
    try:
        fut = start_and_reach_step(
            tmp_path,
            min_workers=2,
            max_workers=3,
            config={"until_world": 2, "min_steps": 21, "extra_steps": 30},
            discovery=FileDiscovery(str(hosts_file)),
            cooldown_range=(60, 60),  # the lost node stays listed: no replacement is tried there
        )
    finally:
        cluster.remove_node(node)
    result = fut.result(timeout=120)
    # rank 0 may be the lost node's worker (hosts seen at once are taken in node-id order): its reports at 3
    # reached the driver before the signal (a node's loss loses a rank's last quarter second of reports)
    assert sizes(result) == [3, 2], result.events
    failed = [e for e in result.events if e.kind == "worker_failed"]
    assert failed and all("its node is gone" in e.detail for e in failed), result.events
    assert result.return_value["world_size"] == 2
    assert_same_state(result)
