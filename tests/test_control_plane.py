"""The run's control plane dying mid-run: the KV (rendezvous) actor is restarted by Ray and the run carries on.

Between resets the rings need no keys, so a KV death costs nothing; in a
rendezvous it costs at most one more reset. Fencing by generation holds
across the restart: the restarted actor is told the current generation.
"""

from __future__ import annotations

import os
import signal

import pytest
from conftest import actor_pid, run_namespaces_alive
from test_integration import assert_same_state, fault, start_and_reach_step
from workloads import counting_train_fn

from ray_elastic import ElasticTrainer

pytestmark = pytest.mark.integration


def test_kv_actor_sigkilled_mid_run_costs_nothing(cluster, no_leaks, tmp_path):
    fut = start_and_reach_step(tmp_path, config={"steps": 120, "deadline_s": 120}, min_workers=4)
    [kv] = [a for a in run_namespaces_alive() if a["name"] == "kv"]
    os.kill(actor_pid("kv", kv["namespace"]), signal.SIGKILL)
    result = fut.result(timeout=120)
    kinds = [e.kind for e in result.events]
    assert kinds == ["start", "kv_restarted"], result.events
    assert result.resets == 0, "no reset, no rollback: the rings needed no keys"
    assert result.return_value["steps"] == 120
    assert [m["step"] for m in result.metrics] == list(range(1, 121)), "every step once, none redone"
    assert_same_state(result)


def test_kv_actor_sigkilled_during_a_rendezvous_costs_one_more_reset(cluster, no_leaks, tmp_path):
    """A member dies, and while the survivors form the next ring the KV actor dies too."""
    faults = [
        fault(tmp_path, rank=3, step=25),
        {**fault(tmp_path, rank=0, step=0, action="kill_kv", name="kv"), "phase": "rendezvous"},
    ]
    result = ElasticTrainer(
        counting_train_fn,
        min_workers=2,
        max_workers=4,
        config={"faults": faults, "steps": 60, "deadline_s": 120},
        cooldown_range=(60, 60),  # the dead rank's slot stays empty: the world goes 4 -> 3
        verbose=0,
    ).fit()
    kinds = [e.kind for e in result.events]
    assert "kv_restarted" in kinds and "worker_failed" in kinds, result.events
    assert result.resets <= 2, f"at most one more reset than the death needs: {result.events}"
    assert result.return_value["steps"] == 60 and result.return_value["world_size"] == 3
    assert_same_state(result)
