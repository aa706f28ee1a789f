"""On a real local cluster: runs that must never lose trained state or end unclearly.

Each test is a defect a demanding user hit (issue "Nothing lost while fit()
says success"): it failed before the fix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from conftest import actor_pid, run_namespaces_alive, run_placement_groups_alive, wait_until
from runs import assert_same_state, fit_in_thread, sizes, start_and_reach_step
from workloads import FileDiscovery, counting_train_fn

from ray_elastic import ElasticTrainer, TrainingFailedError

pytestmark = pytest.mark.integration


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
    steps = [m["step"] for m in result.metrics_history]
    assert steps == list(range(1, len(steps) + 1)), "the state must be handed over, never restarted from scratch"
    assert result.metrics_history[-1]["rank0"] not in ("w1", "w2"), "training ends on the new pool"
    assert sizes(result)[-1] == 2
    assert {e.kind for e in result.events} >= {"hosts_removed", "hosts_added"}
    assert not [e for e in result.events if e.kind in ("worker_failed", "restarted")]
    assert_same_state(result)


def test_ranks_finishing_at_different_steps_fail_at_once_with_rank0s_value(cluster, no_leaks):
    """Found trying it: uneven shards waited 900 s and ended in RayTaskError(RendezvousTimeoutError)."""
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        ElasticTrainer(
            counting_train_fn,
            2,
            3,
            config={"steps": 10**6, "rank0_returns_at": 15},
            collective_timeout=10,  # bounds a peer whose Gloo never hears of rank 0's exit
            verbose=0,
        ).fit()
    assert time.monotonic() - started < 60
    message = str(info.value)
    assert message.startswith("rank 0 (w1) returned from train_fn while rank 1 (w2), rank 2 (w3) still ran")
    assert "same step" in message
    assert info.value.return_value == {"steps": 15, "rank0": "w1"}


def test_rank0_lost_after_the_others_returned_fails_fit_instead_of_a_success_without_its_value(
    cluster, no_leaks, tmp_path
):
    """Issue 34: rank 0 SIGKILLed after its loop, its peer already returned: fit() said success, return_value=None."""
    linger = tmp_path / "rank0_lingers"
    fut = fit_in_thread(
        ElasticTrainer(
            counting_train_fn,
            2,
            2,
            config={"steps": 10, "rank0_linger_file": str(linger), "deadline_s": 120},
            verbose=0,
        )
    )
    rank0 = wait_until(lambda: linger.exists() and linger.read_text(), 120, "rank 0 to leave its training loop")
    [namespace] = {a["namespace"] for a in run_namespaces_alive()}
    others = {"w1", "w2"} - {rank0}
    wait_until(lambda: not others & {a["name"] for a in run_namespaces_alive()}, 60, "rank 1's worker to return and go")
    os.kill(actor_pid(rank0, namespace), signal.SIGKILL)
    with pytest.raises(TrainingFailedError) as info:
        fut.result(timeout=120)
    assert str(info.value).startswith(f"rank 0 (worker {rank0} on node "), str(info.value)
    assert "return value" in str(info.value)


def autoscaler_request() -> list:
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def test_concurrent_runs_autoscaler_requests_add_up_and_are_withdrawn(cluster, no_leaks, tmp_path):
    """Found trying it: two runs overwrote each other's request; Ctrl-C left it set cluster-wide.

    Also the single run's case: a run offered fewer slots than `max_workers` asks for exactly `max_workers`
    bundles of its shape, and withdraws them when it ends. Discovery offers each run one slot on a node of
    its own, so each trains one worker and neither grows into the other's CPUs.
    """
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    (tmp_path / "first.json").write_text(json.dumps({first: 1}))
    (tmp_path / "second.json").write_text(json.dumps({second: 1}))
    runs = [
        fit_in_thread(
            ElasticTrainer(
                counting_train_fn,
                1,
                6,
                config={"steps": 150},
                discovery=FileDiscovery(str(tmp_path / "first.json")),
                verbose=0,
            )
        ),
        fit_in_thread(
            ElasticTrainer(
                counting_train_fn,
                1,
                10,
                config={"steps": 60},
                discovery=FileDiscovery(str(tmp_path / "second.json")),
                resources_per_worker={"CPU": 0.5},
                verbose=0,
            )
        ),
    ]
    # one slot offered, 6 and 10 wanted: each run asks for room for its max_workers, and the requests add up
    wait_until(
        lambda: (
            sorted(map(json.dumps, autoscaler_request()))
            == sorted([json.dumps({"CPU": 1.0})] * 6 + [json.dumps({"CPU": 0.5})] * 10)
        ),
        60,
        "both runs' bundles in the autoscaler request",
    )
    results = [r.result(timeout=180) for r in runs]
    assert [r.return_value["steps"] for r in results] == [150, 60]
    assert [sizes(r) for r in results] == [[1], [1]], "each run trained the one slot its discovery offered"
    assert autoscaler_request() == [], "each run withdraws its share when it ends"


@ray.remote(num_cpus=0)
class SlowToStopDriver:
    """Stands in for a driver whose stop() takes a while, so a second Ctrl-C lands during the clean-up."""

    def stop(self, token: str, reason: str) -> None:
        time.sleep(3)


def test_a_second_ctrl_c_during_cleanup_still_frees_everything(cluster, no_leaks):
    from ray.util.placement_group import placement_group

    from ray_elastic.auth import Authed, RunToken
    from ray_elastic.trainer.driver_watch import cleanup as _cleanup

    namespace = "ray_elastic_ctrlc_test"
    driver = SlowToStopDriver.options(name="driver", namespace=namespace).remote()
    pgs = [placement_group([{"CPU": 0.01}], name=f"{namespace}-w{i}") for i in range(3)]
    ray.get([pg.ready() for pg in pgs], timeout=30)
    ray.get(driver.__ray_ready__.remote(), timeout=30)
    timer = threading.Timer(0.5, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        _cleanup(Authed(driver, RunToken()), None, "ctrlc-test", namespace, graceful=False)
    # the interrupt reached the caller only once the clean-up was done: the placement groups are gone already
    assert not [name for name in run_placement_groups_alive() if name.startswith(namespace)]


def test_two_threads_calling_fit_in_a_fresh_process_both_train(cluster, no_leaks, tmp_path):
    """Found trying it: two threads' first fit() in a fresh process crashed it (two ray.init at once)."""
    script = tmp_path / "two_threads.py"
    script.write_text(
        "import sys, threading\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1] / 'support')!r})\n"
        "from workloads import counting_train_fn\n"
        "from ray_elastic import ElasticTrainer\n"
        "results = []\n"
        "def fit():\n"
        "    results.append(ElasticTrainer(counting_train_fn, 1, 1, config={'steps': 10}, verbose=0).fit())\n"
        "threads = [threading.Thread(target=fit) for _ in range(2)]\n"
        "[t.start() for t in threads]\n"
        "[t.join(240) for t in threads]\n"
        "print('steps', sorted(r.return_value['steps'] for r in results))\n"
    )
    # a fresh process: neither thread finds Ray initialized, both call ray.init (here: of the test cluster)
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps [10, 10]" in done.stdout, done.stdout + done.stderr[-2000:]


def test_a_users_own_importable_class_reaches_the_workers_as_itself(cluster, no_leaks, tmp_path):
    """Found trying it: a class from the user's module arrived as a copy (isinstance False, torch.save failed)."""
    (tmp_path / "usermodel.py").write_text(
        "import ray_elastic as elastic\n"
        "class Config:\n"
        "    def __init__(self, steps):\n"
        "        self.steps = steps\n"
        "def train_fn(config):\n"
        "    import usermodel\n"
        "    @elastic.run\n"
        "    def train(state):\n"
        "        return isinstance(config['cfg'], usermodel.Config), usermodel.Config(config['cfg'].steps)\n"
        "    return train(elastic.ObjectState(step=0))\n"
    )
    (tmp_path / "main.py").write_text(
        "import usermodel\n"
        "from ray_elastic import ElasticTrainer\n"
        "result = ElasticTrainer(usermodel.train_fn, 2, 2, config={'cfg': usermodel.Config(7)}, verbose=0).fit()\n"
        "same_in_worker, back = result.return_value\n"
        "print('worker isinstance', same_in_worker, 'back isinstance', isinstance(back, usermodel.Config))\n"
    )
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    done = subprocess.run(
        [sys.executable, "main.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker isinstance True back isinstance True" in done.stdout, done.stdout + done.stderr[-2000:]


def test_a_crash_repeating_at_the_same_step_ends_the_run_instead_of_looping(cluster, no_leaks, tmp_path):
    """Found trying it: a deterministic crash was retried forever (45 crashes in 120 s, still running)."""
    crash = {"rank": 1, "step": 12, "action": "sigkill", "repeat": True, "marker": str(tmp_path / "unused")}
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        ElasticTrainer(
            counting_train_fn,
            2,
            3,
            config={"steps": 10**6, "faults": [crash]},
            cooldown_range=(0.1, 0.1),
            verbose=0,
        ).fit()
    message = str(info.value)
    assert "failed 3 times in a row resuming from the same commit (2)" in message, message
    assert "died" in message or "ActorDiedError" in message
    assert time.monotonic() - started < 120


def test_a_gil_holding_c_call_is_no_hang_while_it_computes_and_is_one_when_it_sleeps(cluster, no_leaks, tmp_path):
    """Found trying it: a C call keeping the GIL past liveness_timeout had its worker killed, at that step each time.

    One run, two calls on rank 1: at step 10 one computes for 6 s holding the GIL (not taken for a hang), at
    step 20 one sleeps holding it (looks like a deadlock from outside: killed as hung, as fast as before).
    """
    from workloads import _compute_holding_the_gil

    # the premise: the call silences every other thread of the process, as it silences the worker's ping
    ticks: list[float] = []

    def tick() -> None:
        for _ in range(150):
            ticks.append(time.monotonic())
            time.sleep(0.01)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    _compute_holding_the_gil(1.5)  # calibrated on CPU time: 1.5 s leaves room for a calibration under load
    ticker.join()
    assert max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) > 0.8

    busy_marker, stuck_marker = tmp_path / "busy", tmp_path / "stuck"
    busy = {"rank": 1, "step": 10, "action": "gil_busy", "seconds": 6, "marker": str(busy_marker)}
    stuck = {"rank": 1, "step": 20, "action": "gil_sleep", "seconds": 300, "marker": str(stuck_marker)}
    result = ElasticTrainer(
        counting_train_fn,
        1,
        2,
        config={"steps": 30, "faults": [busy, stuck]},
        liveness_timeout=2,
        cooldown_range=(60, 60),
        verbose=0,
    ).fit()
    # the computing call (about 6 s, calibrated under load) outlasted liveness_timeout=2 s several times over:
    # the ranks waited it out, and rank 1 was still there at step 20 for the second call
    assert stuck_marker.exists(), f"rank 1 gone before step 20, its computing call taken for a hang: {result.events}"
    busy_at = json.loads(busy_marker.read_text())["time"]
    after_busy = next(t for m, t in zip(result.metrics_history, result.metric_times, strict=True) if m["step"] == 11)
    assert after_busy - busy_at > 3.0, "the ranks waited out rank 1's call"
    assert [m["step"] for m in result.metrics_history][:20] == list(range(1, 21))
    fired = json.loads(stuck_marker.read_text())
    [failed] = [e for e in result.events if e.kind == "worker_failed"]
    assert [e.kind for e in result.events if e.time < fired["time"]] == ["start"], result.events
    assert fired["worker"] in failed.detail
    # a missed ping (2 s, a round every 2/3 s) and a CPU reading (0.5 s, bounded by 2 s)
    assert failed.time - fired["time"] < 6.5, failed.time - fired["time"]
    assert result.return_value["steps"] == 30
