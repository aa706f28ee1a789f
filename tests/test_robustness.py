"""On a real local cluster: runs that must never lose trained state or end unclearly.

Each test is a defect a demanding user hit (issue "Nothing lost while fit()
says success"): it failed before the fix.
"""

from __future__ import annotations

import json
import time

import pytest
from conftest import wait_until
from test_integration import assert_same_state, sizes, start_and_reach_step
from workloads import BlipDiscovery, FileDiscovery, counting_train_fn

from ray_elastic import ElasticTrainer, TrainingFailedError

pytestmark = pytest.mark.integration


def test_a_discovery_blip_returning_no_hosts_costs_nothing(cluster, no_leaks, tmp_path):
    hosts_file, blip = tmp_path / "hosts.json", tmp_path / "blip"
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts_file.write_text(json.dumps({first: 2, second: 2}))
    fut = start_and_reach_step(
        tmp_path,
        config={"steps": 10**6, "until_world": 4, "min_steps": 60, "extra_steps": 20},
        discovery=BlipDiscovery(str(hosts_file), str(blip)),
        discovery_interval=0.2,
    )
    blip.touch()
    wait_until(lambda: not blip.exists(), 30, "discovery to answer {} once")
    result = fut.result(timeout=120)
    steps = [m["step"] for m in result.metrics]
    assert steps == list(range(1, len(steps) + 1)), "nothing may be rolled back or restarted"
    assert [e.kind for e in result.events] == ["start"] and result.resets == 0
    assert_same_state(result)


def test_a_replaced_host_pool_hands_the_trained_state_over(cluster, no_leaks, tmp_path):
    """Every host withdrawn at once for others: the newcomers must continue the training, not restart it."""
    hosts_file = tmp_path / "hosts.json"
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts_file.write_text(json.dumps({first: 2}))
    fut = start_and_reach_step(
        tmp_path,
        min_workers=1,
        max_workers=2,
        config={"until_world": 2, "until_rank0_not_in": ["w1", "w2"], "extra_steps": 20, "deadline_s": 150},
        discovery=FileDiscovery(str(hosts_file)),
        discovery_interval=0.2,
    )
    hosts_file.write_text(json.dumps({second: 2}))
    result = fut.result(timeout=180)
    steps = [m["step"] for m in result.metrics]
    assert steps == list(range(1, len(steps) + 1)), "the state must be handed over, never restarted from scratch"
    assert result.metrics[-1]["rank0"] not in ("w1", "w2"), "training ends on the new pool"
    assert sizes(result)[-1] == 2
    assert {e.kind for e in result.events} >= {"hosts_removed", "hosts_added"}
    assert not [e for e in result.events if e.kind in ("worker_failed", "restarted")]
    assert_same_state(result)


def test_ranks_finishing_at_different_steps_fail_at_once_with_rank0s_value(cluster, no_leaks):
    """Found trying it: uneven shards waited 900 s and ended in RayTaskError(RendezvousTimeoutError)."""
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        ElasticTrainer(counting_train_fn, 2, 3, config={"steps": 10**6, "rank0_returns_at": 15}, verbose=0).fit()
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert message.startswith("rank 0 (w1) returned from train_fn while rank 1 (w2), rank 2 (w3) still ran")
    assert "same step" in message
    assert info.value.return_value == {"steps": 15, "rank0": "w1"}
