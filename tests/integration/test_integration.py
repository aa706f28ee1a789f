"""End to end on a real local multi-node Ray cluster: the elastic behaviours.

Each test runs `ElasticTrainer.fit()` on the session's cluster (2 nodes x 2
CPUs) with `counting_train_fn`, injects a fault or changes the cluster, and
reads what happened from the `Result`: rank 0's per-step metrics tell the
world size at each step and whether steps were redone; the returned digests
tell whether all ranks ended with bitwise-equal state.
"""

from __future__ import annotations

import json
import time

import pytest
import ray
from conftest import actor_pid, run_namespaces_alive, wait_until
from runs import assert_same_state, fault, fit_in_thread, sizes, start_and_reach_step
from workloads import FileDiscovery, counting_train_fn

import ray_elastic as elastic
from ray_elastic import ElasticTrainer, TrainingFailedError

pytestmark = pytest.mark.integration


def first_after(result, since: float):
    return next((t, m) for t, m in zip(result.metric_times, result.metrics_history, strict=False) if t > since)


def test_sigkill_recovers_from_last_commit_and_refills_the_slot(cluster, no_leaks, tmp_path):
    f = fault(tmp_path, rank=2, step=32)
    result = ElasticTrainer(
        counting_train_fn,
        min_workers=2,
        max_workers=4,
        config={"faults": [f], "until_world": 4, "min_steps": 40, "extra_steps": 20},
        cooldown_range=(1, 5),
        verbose=0,
    ).fit()
    assert sizes(result) == [4, 3, 4]
    killed_at = json.loads(open(f["marker"]).read())["time"]
    recovered_at, first = next(
        (t, m)
        for t, m in zip(result.metric_times, result.metrics_history, strict=False)
        if t > killed_at and m["world_size"] == 3
    )
    # the kill came after step 32, before its commit: survivors resume from the commit at step 30
    assert first["step"] == 31
    print(f"SIGKILL -> survivors' next completed step: {recovered_at - killed_at:.3f} s")
    kinds = [e.kind for e in result.events]
    assert kinds[:2] == ["start", "worker_failed"] and "hosts_added" in kinds
    assert all(e.reset_duration is not None for e in result.events)
    assert_same_state(result)  # the newcomer received the state by sync


def test_ray_kill_of_a_worker_recovers(cluster, no_leaks, tmp_path):
    fut = start_and_reach_step(
        tmp_path,
        min_workers=2,
        max_workers=4,
        config={
            "until_world": 3,
            "min_steps": 21,
            "extra_steps": 30,
        },
        cooldown_range=(30, 60),  # keep the slot empty: the run ends at world size 3
    )
    [victim] = [a for a in run_namespaces_alive() if a["name"] == "w4"]
    killed_at = time.time()
    ray.kill(ray.get_actor("w4", namespace=victim["namespace"]))
    result = fut.result(timeout=120)
    assert sizes(result) == [4, 3]
    assert result.return_value["world_size"] == 3
    assert [e.kind for e in result.events] == ["start", "worker_failed"]
    t, m = first_after(result, killed_at + result.events[1].reset_duration)
    assert m["world_size"] == 3
    assert_same_state(result)


def test_node_added_grows_the_world_without_rollback(cluster, no_leaks, tmp_path):
    fut = start_and_reach_step(
        tmp_path,
        min_workers=2,
        max_workers=6,
        config={"until_world": 6, "extra_steps": 20},
    )
    node = cluster.add_node(num_cpus=2)
    added_at = time.time()
    try:
        result = fut.result(timeout=120)
    finally:
        cluster.remove_node(node)
    assert sizes(result) == [4, 6]
    steps = [m["step"] for m in result.metrics_history]
    assert steps == list(range(1, len(steps) + 1)), "a graceful add must not roll back"
    # survivors kept training while the newcomers booted
    history = zip(result.metric_times, result.metrics_history, strict=False)
    during_boot = [m for t, m in history if t > added_at and m["world_size"] == 4]
    assert len(during_boot) >= 10
    added = [e for e in result.events if e.kind == "hosts_added"]
    assert len(added) == 1 and added[0].world_size == 6 and added[0].reset_duration is not None
    assert_same_state(result)


def test_node_withdrawn_by_discovery_leaves_cleanly(cluster, no_leaks, tmp_path):
    hosts_file = tmp_path / "hosts.json"
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts_file.write_text(json.dumps({first: 2, second: 2}))
    fut = start_and_reach_step(
        tmp_path,
        min_workers=2,
        max_workers=4,
        config={
            "min_steps": 21,
            "until_world": 2,
            "extra_steps": 30,
        },
        discovery=FileDiscovery(str(hosts_file)),
    )
    hosts_file.write_text(json.dumps({first: 2}))
    result = fut.result(timeout=120)
    assert sizes(result) == [4, 2]
    steps = [m["step"] for m in result.metrics_history]
    assert steps == list(range(1, len(steps) + 1)), "a graceful removal must not roll back"
    assert [e.kind for e in result.events] == ["start", "hosts_removed"]
    assert_same_state(result)


def test_rank0_killed_oldest_survivor_takes_over_with_the_commit(cluster, no_leaks, tmp_path):
    f = fault(tmp_path, rank=0, step=32)
    result = ElasticTrainer(
        counting_train_fn,
        min_workers=2,
        max_workers=4,
        config={"faults": [f], "steps": 80},
        cooldown_range=(30, 60),
        verbose=0,
    ).fit()
    victim = json.loads(open(f["marker"]).read())["worker"]
    before = {m["rank0"] for m in result.metrics_history if m["world_size"] == 4}
    after = [m for m in result.metrics_history if m["world_size"] == 3]
    assert before == {victim} == {"w1"}
    assert after[0]["rank0"] == "w2", "the oldest survivor becomes rank 0"
    assert after[0]["step"] == 31, "state rolls back to the last commit (step 30)"
    assert result.return_value["steps"] == 80
    assert_same_state(result)


def test_all_workers_failing_is_a_clear_error(cluster, no_leaks, tmp_path):
    faults = [fault(tmp_path, rank=r, step=10) for r in range(4)]
    started = time.monotonic()
    with pytest.raises(
        TrainingFailedError,
        match=r"all \d+ workers of generation \d+ were lost \(w\d+(, w\d+)*\); no survivor holds the training state",
    ):
        ElasticTrainer(counting_train_fn, 2, 4, config={"faults": faults, "steps": 100}, verbose=0).fit()
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("discovery_interval", [1.0, 0.1])
def test_min_workers_never_reached_fails_within_elastic_timeout(cluster, no_leaks, discovery_interval):
    """At 0.1 s, discovery keeps the driver's queue busy: the deadline must hold whatever the message rate."""
    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match=r"min_workers=5 not reached within elastic_timeout=5 s"):
        ElasticTrainer(
            counting_train_fn,
            5,
            5,
            config={"steps": 10},
            elastic_timeout=5,
            discovery_interval=discovery_interval,
            verbose=0,
        ).fit()
    assert time.monotonic() - started < 5 + 30


def test_reset_limit_exceeded_fails(cluster, no_leaks, tmp_path):
    f = fault(tmp_path, rank=1, step=12)
    with pytest.raises(TrainingFailedError, match="reset_limit=0 reached"):
        ElasticTrainer(counting_train_fn, 2, 4, config={"faults": [f], "steps": 200}, reset_limit=0, verbose=0).fit()


def test_user_exception_fails_fast_with_its_traceback(cluster, no_leaks, tmp_path):
    f = fault(tmp_path, rank=1, step=5, action="raise")
    with pytest.raises(TrainingFailedError) as info:
        ElasticTrainer(counting_train_fn, 2, 4, config={"faults": [f], "steps": 10**6}, verbose=0).fit()
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


def test_reset_callbacks_see_the_new_world_size(cluster, no_leaks, tmp_path):
    f = fault(tmp_path, rank=1, step=12)
    result = ElasticTrainer(
        counting_train_fn, 2, 4, config={"faults": [f], "steps": 40}, cooldown_range=(30, 60), verbose=0
    ).fit()
    # rank 0 survived the failure: its callbacks ran once, after the ring of 3 existed
    assert result.return_value["reset_sizes"] == [3]


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


def test_hung_worker_is_killed_by_the_liveness_check(cluster, no_leaks, tmp_path):
    import os
    import signal

    fut = start_and_reach_step(
        tmp_path,
        min_workers=2,
        max_workers=4,
        config={
            "until_world": 3,
            "min_steps": 21,
            "extra_steps": 20,
        },
        liveness_timeout=2,
        cooldown_range=(60, 60),
    )
    [victim] = [a for a in run_namespaces_alive() if a["name"] == "w3"]
    pid = actor_pid("w3", victim["namespace"])
    os.kill(pid, signal.SIGSTOP)
    result = fut.result(timeout=120)
    assert sizes(result) == [4, 3]
    assert "w3" in result.events[1].detail and result.events[1].kind == "worker_failed"
    assert_same_state(result)


def test_discovery_failing_on_first_call_fails_at_once(cluster, no_leaks):
    def broken_discovery() -> dict:
        raise ConnectionError("inventory service unreachable")

    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match="inventory service unreachable"):
        ElasticTrainer(counting_train_fn, 2, 4, config={"steps": 5}, discovery=broken_discovery, verbose=0).fit()
    assert time.monotonic() - started < 30


def test_missing_slots_are_requested_from_the_autoscaler(cluster, no_leaks, tmp_path):
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    def requested() -> list:
        raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
        return json.loads(raw) if raw else []

    fut = fit_in_thread(ElasticTrainer(counting_train_fn, 2, 6, config={"steps": 400}, verbose=0))
    # 4 slots exist, 6 are wanted: the autoscaler is asked for room for max_workers
    wait_until(lambda: requested() == [{"CPU": 1.0}] * 6, 60, "an autoscaler request for 6 worker bundles")
    fut.result(timeout=120)
    assert requested() == [], "the request is withdrawn when the run ends"


def test_node_lost_its_workers_leave_and_training_goes_on(cluster, no_leaks, tmp_path):
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    try:
        fut = start_and_reach_step(
            tmp_path, max_workers=6, config={"until_world": 4, "min_steps": 21, "extra_steps": 30}
        )
    finally:
        cluster.remove_node(node)
    result = fut.result(timeout=120)
    assert sizes(result)[0] == 6 and sizes(result)[-1] == 4
    failed = [e for e in result.events if e.kind == "worker_failed"]
    assert failed and all("its node is gone" in e.detail for e in failed)
    assert result.return_value["world_size"] == 4
    assert_same_state(result)
