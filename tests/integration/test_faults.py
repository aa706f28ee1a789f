"""The fault matrix, cell by cell, on a real local multi-node cluster.

Each cell either recovers (the run finishes, every rank ends with the same
state) or fails within a bounded time with a clear error; `no_leaks` checks
that no actor or placement group of the run is left either way. Horovod's
known failure modes each have a cell, named after their issue number.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
from conftest import run_namespaces_alive, wait_until
from runs import assert_same_state, fault, fit_in_thread, sizes, start_and_reach_step
from workloads import FileDiscovery, counting_train_fn

from ray_elastic import ElasticTrainer, TrainingFailedError

pytestmark = pytest.mark.integration


def phased(tmp_path, rank, step, phase, action="sigkill", name="p") -> dict:
    return {**fault(tmp_path, rank, step, action, name=name), "phase": phase}


def run(config: dict, **kwargs):
    kwargs.setdefault("cooldown_range", (60, 60))
    return ElasticTrainer(
        counting_train_fn,
        kwargs.pop("min_workers", 2),
        kwargs.pop("max_workers", 4),
        config=config,
        verbose=0,
        **kwargs,
    ).fit()


# the failure inside a commit (rolled back to that commit) is the run of
# test_observability_cluster.py::test_ray_metrics_reach_prometheus_and_the_timeline_plots_a_real_run


def test_failure_inside_the_sync_broadcast_leads_to_another_reset(cluster, no_leaks, tmp_path):
    faults = [fault(tmp_path, rank=2, step=12), phased(tmp_path, rank=1, step=1, phase="sync")]
    result = run({"faults": faults, "steps": 60})
    assert sizes(result) == [4, 2]
    assert [e.kind for e in result.events].count("worker_failed") == 2
    assert result.return_value["steps"] == 60
    assert_same_state(result)


def test_horovod_3014_failure_during_a_reset_round(cluster, no_leaks, tmp_path):
    """A worker dies inside its reset callback while the others are already re-forming."""
    faults = [fault(tmp_path, rank=3, step=12), phased(tmp_path, rank=1, step=1, phase="reset_callback")]
    started = time.monotonic()
    result = run({"faults": faults, "steps": 60})
    assert time.monotonic() - started < 120
    assert sizes(result) == [4, 2] and result.return_value["steps"] == 60
    assert_same_state(result)


def test_failure_inside_the_rendezvous_of_a_new_generation(cluster, no_leaks, tmp_path):
    faults = [fault(tmp_path, rank=3, step=12), phased(tmp_path, rank=1, step=1, phase="rendezvous")]
    result = run({"faults": faults, "steps": 60})
    # rank 1 died while generation 2 formed: the ring of 3 never trained, the next one of 2 did
    assert sizes(result) == [4, 2] and result.return_value["steps"] == 60
    assert [e.kind for e in result.events].count("worker_failed") == 2
    assert_same_state(result)


def test_user_exceptions_retried_in_place_then_a_user_deadlock_outside_collectives_found_and_killed(
    cluster, no_leaks, tmp_path
):
    """Two cells in one run: ranks 1 and 3 raise at step 12, one failure of the attempt under max_failures=1: nobody
    is killed, every rank re-enters from the commit; then rank 2 is stuck in user code at step 30, still answering
    pings: the others' collective timeout exposes it."""
    deadlock = fault(tmp_path, rank=2, step=30, action="deadlock")
    raises = [fault(tmp_path, rank=r, step=12, action="raise", name=f"raise{r}") for r in (1, 3)]
    started = time.monotonic()
    result = run({"faults": [*raises, deadlock], "steps": 60}, max_failures=1, collective_timeout=3)
    assert time.monotonic() - started < 90
    assert sizes(result) == [4, 3] and result.return_value["steps"] == 60
    assert all(Path(f["marker"]).exists() for f in raises), "both ranks raised"
    [retried] = [e for e in result.events if e.kind == "reset_requested"]
    assert ("rank 1" in retried.detail or "rank 3" in retried.detail) and "retry 1 of max_failures=1" in retried.detail
    assert "re-enters train_fn from the last commit" in retried.detail
    [failed] = [e for e in result.events if e.kind == "worker_failed"]  # the raises killed nobody
    stuck = json.loads(Path(deadlock["marker"]).read_text())["worker"]
    assert f"worker {stuck} " in failed.detail, failed.detail
    assert_same_state(result)


def test_deadlock_inside_collectives_fails_with_its_reason_instead_of_looping(cluster, no_leaks, tmp_path):
    """Every rank alive and inside a collective: re-forming the ring would repeat it, so the run stops."""
    f = fault(tmp_path, rank=1, step=15, action="stuck_in_collective")
    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match="timed out twice in a row .* deadlock in train_fn"):
        # both ranks are inside the collective: rank 1 "stuck" in it, rank 0 waiting for it there
        run({"faults": [f], "steps": 10**6, "deadline_s": 120}, collective_timeout=3, max_workers=2)
    assert time.monotonic() - started < 60


def test_two_workers_at_once(cluster, no_leaks, tmp_path):
    faults = [fault(tmp_path, rank=1, step=15), fault(tmp_path, rank=3, step=15, action="exit")]
    result = run({"faults": faults, "steps": 60})
    assert sizes(result) == [4, 2]
    assert [e.generation for e in result.events if e.kind == "worker_failed"] in ([2, 2], [2, 3])
    assert_same_state(result)


def test_horovod_2652_newcomer_hanging_in_its_first_sync(cluster, no_leaks, tmp_path):
    """The first replacement hangs (SIGSTOP) in its first sync: the liveness check kills it, the next one joins."""
    faults = [
        fault(tmp_path, rank=2, step=12),
        phased(tmp_path, rank="newcomer", step=0, phase="newcomer_sync", action="hang"),
    ]
    result = run(
        {"faults": faults, "until_world": 3, "min_steps": 50, "extra_steps": 20, "deadline_s": 150},
        cooldown_range=(1, 2),
        liveness_timeout=2,
        max_workers=3,
    )
    assert sizes(result)[0] == 3 and sizes(result)[-1] == 3
    assert [e.kind for e in result.events].count("worker_failed") == 2  # the victim, then the hung newcomer
    assert_same_state(result)


def test_horovod_3494_survivors_below_min_workers_after_a_graceful_removal(cluster, no_leaks, tmp_path):
    """Horovod deadlocks here; we keep training the old ring and fail clearly at elastic_timeout."""
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps({first: 1, second: 1}))
    fut = start_and_reach_step(
        tmp_path,
        min_workers=2,
        config={"steps": 10**7, "deadline_s": 120},
        discovery=FileDiscovery(str(hosts_file)),
        # also the first workers' boot deadline: two processes importing torch at once on 2 loaded cores take
        # 10-15 s (four took 28 s once, and 15 s failed the run before the removal this test is about)
        elastic_timeout=30,
    )
    hosts_file.write_text(json.dumps({first: 1}))
    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match=r"min_workers=2 not reached within elastic_timeout=30 s"):
        fut.result(timeout=120)
    assert time.monotonic() - started < 30 + 30


def test_driver_actor_killed_fails_fast_and_cleanly(cluster, no_leaks, tmp_path):
    fut = start_and_reach_step(tmp_path, config={"steps": 10**7, "deadline_s": 120}, max_workers=2)
    [driver] = [a for a in run_namespaces_alive() if a["name"] == "driver"]
    ray.kill(ray.get_actor("driver", namespace=driver["namespace"]))
    with pytest.raises(TrainingFailedError, match="the run's driver actor died"):
        fut.result(timeout=60)


def test_kv_actor_killed_fails_fast_and_cleanly(cluster, no_leaks, tmp_path):
    fut = start_and_reach_step(tmp_path, config={"steps": 10**7, "deadline_s": 120}, max_workers=2)
    [kv] = [a for a in run_namespaces_alive() if a["name"] == "kv"]
    ray.kill(ray.get_actor("kv", namespace=kv["namespace"]))
    with pytest.raises(TrainingFailedError, match=r"rendezvous \(KV\) actor died"):
        fut.result(timeout=60)


def test_two_trainers_at_once_do_not_see_each_other(cluster, no_leaks):
    runs = [
        fit_in_thread(ElasticTrainer(counting_train_fn, 2, 2, config={"steps": 150 + 50 * i}, verbose=0))
        for i in range(2)
    ]
    # both runs live side by side, each in its own namespace with its own KV actor
    wait_until(
        lambda: len({a["namespace"] for a in run_namespaces_alive() if a["name"] == "kv"}) == 2,
        60,
        "two runs alive at once",
    )
    results = [r.result(timeout=120) for r in runs]
    for i, result in enumerate(results):
        assert [m["step"] for m in result.metrics_history] == list(range(1, 151 + 50 * i))
        assert result.resets == 0 and sizes(result) == [2]
        assert_same_state(result)


# ---- discovery that misbehaves, end to end ------------------------------------

_SCRIPT = """#!/bin/sh
echo call >> {calls}
case "$(cat {mode})" in
  ok) cat {hosts} ;;
  garbage) echo '%% this is not a host line %%' ;;
  fail) echo 'inventory service unreachable' >&2; exit 7 ;;
  hang) exec sleep 600 ;;
  blip) echo ok > {mode} ;;
esac
"""


def discovery_script(tmp_path, cluster, mode: str):
    """An executable discovery script whose behaviour the test switches through a file."""
    paths = {name: tmp_path / name for name in ("calls", "mode", "hosts")}
    paths["calls"].write_text("")
    paths["mode"].write_text(mode)
    paths["hosts"].write_text("".join(f"{n.node_id}:2\n" for n in cluster.worker_nodes_at_start))
    script = tmp_path / "discover.sh"
    script.write_text(_SCRIPT.format(**paths))
    script.chmod(0o755)
    return script, paths


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("garbage", r"line 1.*not a host line"),
        ("fail", r"exited with 7: inventory service unreachable"),
        ("hang", r"did not (finish|answer) within 2 s"),
    ],
)
def test_discovery_failing_at_start_fails_fit_with_its_reason(cluster, no_leaks, tmp_path, mode, message):
    script, _ = discovery_script(tmp_path, cluster, mode)
    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match=message):
        ElasticTrainer(
            counting_train_fn, 2, 4, config={"steps": 10}, discovery=str(script), discovery_timeout=2, verbose=0
        ).fit()
    assert time.monotonic() - started < 30


# "fail" (a nonzero exit) takes the same path as "garbage" (both raise in the poller): it is covered on the
# first call above and in tests/unit/test_discovery.py; "hang" is the timeout path; "blip" answers no host once
def test_discovery_failing_mid_run_or_blipping_no_hosts_is_retried_while_training_goes_on(cluster, no_leaks, tmp_path):
    """One run through three misbehaving phases of discovery, each of which must cost nothing: garbage, a hang
    (each call cut at discovery_timeout), then one answer of no hosts at all (a blip)."""
    script, paths = discovery_script(tmp_path, cluster, "ok")
    fut = start_and_reach_step(
        tmp_path,
        config={"steps": 1000, "step_time": 0.01},
        max_workers=2,
        discovery=str(script),
        discovery_interval=0.2,
        discovery_timeout=1,
    )

    def calls() -> int:
        return len(paths["calls"].read_text().splitlines())

    for mode in ("garbage", "hang"):
        before = calls()
        paths["mode"].write_text(mode)
        # a call that started before the switch may still read the old mode: 3 calls make 2 in this one
        wait_until(lambda b=before: calls() >= b + 3 or fut.done(), 30, f"discovery polled in mode {mode!r}")
        assert not fut.done(), f"the run ended before the broken ({mode}) discovery was polled while it trained"
    paths["mode"].write_text("blip")  # one answer of no hosts; the script sets its mode back to ok
    wait_until(lambda: paths["mode"].read_text().strip() == "ok" or fut.done(), 30, "discovery to answer {} once")
    assert not fut.done(), "the run ended before the blip"
    result = fut.result(timeout=120)
    steps = [m["step"] for m in result.metrics_history]
    assert steps == list(range(1, 1001)), "nothing may be rolled back or restarted"
    assert [e.kind for e in result.events] == ["start"] and result.resets == 0
    assert sizes(result) == [2], "no worker was lost or added because discovery broke"
    assert result.return_value["steps"] == 1000
    assert_same_state(result)
