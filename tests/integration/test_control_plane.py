"""The run's control plane dying: the KV (rendezvous) and driver actors are restarted by Ray, the run carries on.

Between resets the rings need no keys, so a KV death costs nothing; in a
rendezvous it costs at most one more reset. Fencing by generation holds
across the restart: the restarted actor is told the current generation.
A driver death costs no step: the workers train on while Ray restarts it,
and it resumes from its snapshot (membership, generation, events, reports
not yet fetched). `fit()`'s caller dying takes the whole run with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest
import ray
from conftest import actor_pid, run_namespaces_alive, run_placement_groups_alive, wait_until
from runs import assert_same_state, fault, start_and_reach_step
from workloads import FileDiscovery, counting_train_fn

from ray_elastic import ElasticTrainer, TrainingFailedError

pytestmark = pytest.mark.integration


def three_slots(cluster, tmp_path) -> FileDiscovery:
    """Discovery offering 3 slots (2 on one node, 1 on the other): 3 workers take them all, so a dead worker's
    slot is refilled only when its host's cool-down ends, never at once on a free slot elsewhere."""
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({first: 2, second: 1}))
    return FileDiscovery(str(hosts))


def test_kv_actor_sigkilled_during_a_rendezvous_costs_one_more_reset(cluster, no_leaks, tmp_path):
    """A member dies, and while the survivors form the next ring the KV actor dies too."""
    faults = [
        fault(tmp_path, rank=2, step=25),
        {**fault(tmp_path, rank=0, step=0, action="kill_kv", name="kv"), "phase": "rendezvous"},
    ]
    result = ElasticTrainer(
        counting_train_fn,
        min_workers=2,
        max_workers=3,
        # steps of 50 ms after the kill: the run outlasts the driver's noticing the KV actor's restart (the ranks'
        # ring forms as soon as the KV is back, and 35 steps of 5 ms sometimes ended the run before the driver's event)
        config={"faults": faults, "steps": 60, "step_time": 0.05, "deadline_s": 120},
        discovery=three_slots(cluster, tmp_path),
        cooldown_range=(60, 60),  # the dead rank's slot stays empty: the world goes 3 -> 2
        verbose=0,
    ).fit()
    kinds = [e.kind for e in result.events]
    assert "kv_restarted" in kinds and "worker_failed" in kinds, result.events
    assert result.resets <= 2, f"at most one more reset than the death needs: {result.events}"
    assert result.return_value["steps"] == 60 and result.return_value["world_size"] == 2
    assert_same_state(result)


def steps_once_each(result) -> list[int]:
    """The steps rank 0 reported, each once, in order; a rollback's redone steps are counted by the caller."""
    return sorted({m["step"] for m in result.metrics_history})


def test_driver_then_kv_then_both_sigkilled_mid_run_cost_no_step(cluster, no_leaks, tmp_path):
    """The driver's process SIGKILLed by a test outside the run; later the KV actor's (between resets the rings
    need no keys, so it costs nothing); later still the driver's and the KV actor's at once."""
    # each kill comes seconds after the one before (30 ms steps), once its restart is done
    faults = [
        fault(tmp_path, rank=0, step=100, action="kill_kv"),
        fault(tmp_path, rank=0, step=200, action="kill_both"),
    ]
    config = {"faults": faults, "steps": 260, "step_time": 0.03, "deadline_s": 120}
    fut = start_and_reach_step(tmp_path, config=config, min_workers=2, max_workers=2)
    [driver] = [a for a in run_namespaces_alive() if a["name"] == "driver"]
    os.kill(actor_pid("driver", driver["namespace"]), signal.SIGKILL)
    result = fut.result(timeout=120)
    kinds = [e.kind for e in result.events]
    assert kinds[:3] == ["start", "driver_restarted", "kv_restarted"], result.events
    assert sorted(kinds[3:]) == ["driver_restarted", "kv_restarted"], result.events
    assert result.resets == 0, "no reset and no rollback: the workers trained on without their driver or KV actor"
    assert result.return_value["steps"] == 260 and result.return_value["world_size"] == 2
    # every report reached fit() once and in order, those the dead drivers held unfetched included
    assert [m["step"] for m in result.metrics_history] == list(range(1, 261)), "every step once, none redone"
    assert_same_state(result)


def test_driver_killed_during_a_reset_and_during_a_scale_up(cluster, no_leaks, tmp_path):
    """Rank 2 dies; the driver is SIGKILLed while the survivors form the next ring, and again while the
    replacement (its host back after the cool-down) receives the state."""
    faults = [
        fault(tmp_path, rank=2, step=15),
        {**fault(tmp_path, rank=0, step=10, action="kill_driver", name="in-reset"), "phase": "rendezvous"},
        {
            **fault(tmp_path, rank=0, step=0, action="kill_driver", name="in-scale-up"),
            "rank": "newcomer",
            "phase": "newcomer_sync",
        },
    ]
    # trains until the world, down to 2 after the death, is 3 again, and 20 steps more
    config = {"faults": faults, "until_world": 3, "signal_world_size": 2, "extra_steps": 20, "deadline_s": 150}
    result = ElasticTrainer(
        counting_train_fn,
        min_workers=2,
        max_workers=3,
        config=config,
        discovery=three_slots(cluster, tmp_path),
        cooldown_range=(1, 1),
        verbose=0,
    ).fit()
    kinds = [e.kind for e in result.events]
    assert kinds == ["start", "worker_failed", "driver_restarted", "hosts_added", "driver_restarted"], (
        f"no worker lost or rolled back because of the driver: {result.events}"
    )
    final = result.return_value["steps"]
    assert result.return_value["world_size"] == 3
    steps = [m["step"] for m in result.metrics_history]
    assert steps_once_each(result) == list(range(1, final + 1)), "no step missing"
    assert len(steps) - final <= 5, f"only the steps since the last commit (every 5) are redone: {len(steps) - final}"
    assert_same_state(result)


class RunsCode:
    """A pickle that runs code where it is loaded: what a hostile job writes into the run's snapshot key."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def snapshot_key(namespace: str) -> bytes:
    """The GCS key of the run's driver snapshot (`driver/<run id>`; the run's namespace is `ray_elastic_<run id>`)."""
    return f"driver/{namespace.removeprefix('ray_elastic_')}".encode()


def write_back_until_fit_ends(fut, key: bytes, value: bytes) -> None:
    """Write `value` as the run's snapshot until the restarted driver has read it and `fit()` ended.

    A write can land after `fit()`'s clean-up deleted the snapshot (it ends a moment before the future does):
    the key is deleted once more at the end, so no snapshot of this run outlives the test.
    """
    deadline = time.monotonic() + 120
    try:
        while not fut.done():  # the dead driver writes no more; the restarted one reads what is there
            assert time.monotonic() < deadline, "fit() did not end within 120 s of the driver's restart"
            ray.experimental.internal_kv._internal_kv_put(key, value, overwrite=True, namespace="ray_elastic")
            with contextlib.suppress(FutureTimeout):
                fut.exception(timeout=0.05)  # fit() ending ends the writes
    finally:
        ray.experimental.internal_kv._internal_kv_del(key, namespace="ray_elastic")


def test_a_forged_driver_snapshot_is_refused_and_the_run_fails_naming_why(cluster, no_leaks, tmp_path):
    """Issue 34: another job wrote a pickle into driver/<run_id> and restarted the driver, which ran it."""
    fut = start_and_reach_step(tmp_path, config={"steps": 10**6, "deadline_s": 120}, step=5, max_workers=2)
    [driver] = [a for a in run_namespaces_alive() if a["name"] == "driver"]
    key = snapshot_key(driver["namespace"])
    marker = tmp_path / "hostile_code_ran"
    forged = pickle.dumps(RunsCode(str(marker)))
    ray.kill(ray.get_actor("driver", namespace=driver["namespace"]), no_restart=False)  # needs no token
    write_back_until_fit_ends(fut, key, forged)
    with pytest.raises(TrainingFailedError, match="not signed with this run's secret"):
        fut.result(timeout=120)
    assert not marker.exists(), "the forged snapshot's code never ran"


def test_an_older_snapshot_of_the_run_written_back_is_refused_by_the_restarted_driver(cluster, no_leaks, tmp_path):
    """A signed snapshot of the run itself, from earlier, verifies: its write counter gives it away."""
    fut = start_and_reach_step(tmp_path, config={"steps": 10**6, "deadline_s": 120}, step=5, max_workers=2)
    [driver] = [a for a in run_namespaces_alive() if a["name"] == "driver"]
    key = snapshot_key(driver["namespace"])
    old = ray.experimental.internal_kv._internal_kv_get(key, namespace="ray_elastic")
    newer = lambda: ray.experimental.internal_kv._internal_kv_get(key, namespace="ray_elastic")[32:40]  # noqa: E731
    wait_until(lambda: newer() != old[32:40], 30, "the driver to write a newer snapshot")
    ray.kill(ray.get_actor("driver", namespace=driver["namespace"]), no_restart=False)
    write_back_until_fit_ends(fut, key, old)
    with pytest.raises(TrainingFailedError, match="an older snapshot of this run was written back"):
        fut.result(timeout=120)


def test_fit_callers_process_killed_leaves_nothing_behind(cluster, no_leaks, tmp_path):
    """The workers are detached (they outlive a restarting driver): with the caller gone, they remove the run."""
    script = tmp_path / "caller.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1] / 'support')!r})\n"
        "from workloads import counting_train_fn\n"
        "from ray_elastic import ElasticTrainer\n"
        f"ElasticTrainer(counting_train_fn, 2, 2, config={{'steps': 10**6, 'deadline_s': 600, 'signal_file': "
        f"{str(tmp_path / 'training')!r}, 'signal_step': 5}}, verbose=0).fit()\n"
    )
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    caller = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: (tmp_path / "training").exists() or caller.poll() is not None, 120, "training to start")
        assert caller.poll() is None, caller.communicate()[1][-3000:]
        assert len(run_placement_groups_alive()) == 2
    finally:
        caller.kill()
        caller.communicate()
    # Ray kills the caller's driver actor (owned by the caller); the orphaned workers remove the rest
    wait_until(lambda: not run_namespaces_alive(), 60, f"the run's actors to go: {run_namespaces_alive()}")
    wait_until(lambda: not run_placement_groups_alive(), 30, f"placement groups to go: {run_placement_groups_alive()}")
    leftovers = ray.experimental.internal_kv._internal_kv_list(b"driver/", namespace="ray_elastic")
    assert leftovers == [], f"the driver's snapshot stays behind: {leftovers}"
