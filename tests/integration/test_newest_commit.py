"""Rank 0 holds the newest commit, on a real cluster: a newcomer held back until every holder is gone.

The sequence: w1 and w2 train; w3 boots and is held before its run loop;
w4 boots, and is admitted when w2 dies, and syncs; then w1 dies. Only w4
holds the trained state when w3 finally says it is ready. w3 is older
(spawned first), and ranks used to follow spawn age: w3 became rank 0 and
its untrained state overwrote w4's, sending the step counter back to 0.
Now w4 is rank 0 and training goes on from its commit.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_until
from runs import fit_in_thread
from workloads import FileDiscovery

import ray_elastic as elastic
from ray_elastic import ElasticTrainer
from ray_elastic.runtime.process import current

pytestmark = pytest.mark.integration


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.05)


def held_newcomer_train_fn(config: dict) -> dict:
    """Counts steps in lockstep; `kill-<id>` files SIGKILL a worker, w3 waits for `release` before its loop.

    `finish` ends the run once two workers are left; `abort` ends it whatever the world (a failed test).
    """
    folder = Path(config["folder"])
    me = current().worker_id
    (folder / f"booted-{me}").touch()
    if me == config["held"]:
        (folder / f"holding-{me}").touch()
        _wait_for(folder / "release", 600)  # the test's own waits bound the run; a loaded machine is slow
    state = elastic.ObjectState(step=0, weights=np.zeros(4))

    @elastic.run
    def train(state: elastic.ObjectState) -> dict:
        while True:
            if (folder / f"kill-{me}").exists():
                os.kill(os.getpid(), signal.SIGKILL)
            finish = (folder / "abort").exists() or (elastic.size() == 2 and (folder / "finish").exists())
            if elastic.allreduce(np.array([float(finish)]), elastic.Max)[0]:
                return {"worker": me, "rank": elastic.rank(), "step": state.step, "weights": state.weights.tolist()}
            state.weights = state.weights + elastic.allreduce(np.ones(4), elastic.Average)
            state.step += 1
            if elastic.rank() == 0:
                progress = {"step": state.step, "world_size": elastic.size(), "rank0": me}
                (folder / "progress.tmp").write_text(json.dumps(progress))
                os.replace(folder / "progress.tmp", folder / "progress.json")
            elastic.report({"step": state.step, "world_size": elastic.size(), "rank0": me})
            time.sleep(0.01)
            if state.step % 5 == 0:
                state.commit()
            else:
                state.check_host_updates()

    return train(state)


def test_a_newcomer_held_back_until_every_holder_is_gone_does_not_overwrite_the_trained_state(
    cluster, no_leaks, tmp_path
):
    a, b = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({a: 1, b: 1}))

    def progress() -> dict:
        try:
            return json.loads((tmp_path / "progress.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    trainer = ElasticTrainer(
        held_newcomer_train_fn,
        min_workers=2,
        max_workers=4,
        discovery=FileDiscovery(str(hosts)),
        discovery_interval=0.2,
        cooldown_range=(600.0, 600.0),  # no replacement for a killed worker: only w3 and w4 are left
        config={"folder": str(tmp_path), "held": "w3"},
        verbose=0,
    )
    fut = fit_in_thread(trainer)

    def until(predicate, what: str) -> None:
        """Wait for `predicate`, or for fit() to end early (then its error is the test's)."""
        wait_until(lambda: fut.done() or predicate(), 90, what)
        if fut.done():
            fut.result()
            raise AssertionError(f"fit() returned before {what}")

    try:
        until(lambda: progress().get("step", 0) >= 20, "w1 and w2 to train 20 steps")
        hosts.write_text(json.dumps({a: 2, b: 1}))  # w3 boots on a, and is held
        until((tmp_path / "holding-w3").exists, "w3 to boot and be held")
        hosts.write_text(json.dumps({a: 2, b: 2}))  # w4 boots on b; admitted once w2 dies (w3 holds the resize)
        # w2's death cools node b down: w4 must have started there before it, or it never would
        until((tmp_path / "booted-w4").exists, "w4 to boot")
        at_kill = progress()["step"]
        (tmp_path / "kill-w2").touch()
        until(lambda: progress().get("world_size") == 2 and progress()["step"] >= at_kill + 20, "w1 and w4 to train")
        trained = progress()
        assert trained["rank0"] == "w1"
        (tmp_path / "kill-w1").touch()  # every worker that trained since the start is gone; w4 holds the state
        (tmp_path / "release").touch()  # now w3 says it is ready: w3 and w4 form the next generation
        until(lambda: progress().get("rank0") not in (None, "w1"), "w3 and w4 to train")
    except BaseException:
        (tmp_path / "release").touch()  # end the run, so that its actors do not outlive this test
        (tmp_path / "abort").touch()
        fut.exception(timeout=120)
        raise
    (tmp_path / "finish").touch()
    result = fut.result(timeout=90)
    after = [m for m in result.metrics_history if m["rank0"] != "w1" and m["world_size"] == 2][-40:]
    assert after and {m["rank0"] for m in after} == {"w4"}, "the holder of the trained state is rank 0, not w3"
    resumed = min(m["step"] for m in result.metrics_history if m["rank0"] == "w4")
    assert resumed > trained["step"] - 5, f"training went back from step {trained['step']} to {resumed}"
    assert result.return_value["worker"] == "w4"
    assert result.return_value["weights"] == [float(result.return_value["step"])] * 4
    assert not [e for e in result.events if e.kind == "restarted"]
