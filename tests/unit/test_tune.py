"""Ray Tune trials that are elastic runs, without a cluster.

- A trial's resource request (an empty head and `min_workers` bundles) and
  where it grows; what `as_trainable()` refuses before Tune starts anything.
- The checkpoint handed to Tune: the one its report saw, not pruned while
  Tune copies it, bounded in time; a restored trial resumes from it.

The trials on a real cluster are in integration/test_tune_cluster.py.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import ray_elastic as elastic
from ray_elastic import ElasticTrainer
from ray_elastic.tune.placement import node_to_grow_on, slots, trial_resources

tune = pytest.importorskip("ray.tune")


def quadratic_train_fn(config: dict) -> float:
    """Gradient descent on (w - 3)^2, averaged over the ranks; rank 0 reports every step.

    `kill_after`: once the world has 2 workers at a step >= it, rank 1
    SIGKILLs itself (once: `marker`); the run ends `steps_after_kill` steps
    after rank 0 saw it, else after `steps`. `fail_at`: the run fails there
    once (`fail_marker`), as an interrupted experiment.
    """
    state = elastic.ObjectState(step=0, w=0.0, end=config["steps"])
    fail = config.get("fail_marker")

    @elastic.run
    def train(state: elastic.ObjectState) -> float:
        marker = config.get("marker")
        while state.step < state.end:
            if marker and elastic.size() == 2 and state.step >= config["kill_after"] and not os.path.exists(marker):
                if elastic.rank() == 1:
                    Path(marker).write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
            if fail and state.step == config["fail_at"] and not os.path.exists(fail):
                Path(fail).write_text("")
                raise RuntimeError("the experiment is interrupted here, once")
            grad = elastic.allreduce(np.array([2.0 * (state.w - 3.0)]), op=elastic.Average)[0]
            state.w -= config["lr"] * grad
            time.sleep(config["step_s"])  # the workload's pace: ASHA has rungs to compare
            state.step += 1
            if marker and os.path.exists(marker) and state.end == config["steps"]:
                state.end = state.step + config["steps_after_kill"]
            state.commit()
            elastic.report({"loss": (state.w - 3.0) ** 2, "step": state.step, "world": elastic.size()})
        return state.w

    return train(state)


def test_a_trial_asks_tune_for_its_minimum_and_grows_where_room_is_left():
    assert trial_resources(2, {"CPU": 1.0}) == [{}, {"CPU": 1.0}, {"CPU": 1.0}]
    pgf = tune.PlacementGroupFactory(trial_resources(2, {"CPU": 1.0}))
    assert pgf.required_resources == {"CPU": 2.0} and pgf.head_bundle_is_empty
    free = {"a": {"CPU": 0.5}, "b": {"CPU": 2.0, "memory": 1e9}, "c": {"CPU": 1.0}}
    assert node_to_grow_on(free, {"CPU": 1.0}) == "b"
    assert node_to_grow_on({"a": {"CPU": 0.5}}, {"CPU": 1.0}) is None
    assert slots({"a": 1, "b": 1}, {"b": 1, "c": 1}) == {"a": 1, "b": 2, "c": 1}


def test_what_a_trial_cannot_do_is_refused_before_tune_starts():
    with pytest.raises(ValueError, match="leave discovery=None"):
        ElasticTrainer(quadratic_train_fn, 1, 2, discovery=lambda: {"h": 1}).as_trainable()
    with pytest.raises(ValueError, match="CPU workers for now"):
        ElasticTrainer(quadratic_train_fn, 1, 2, resources_per_worker={"CPU": 1, "GPU": 1}).as_trainable()


def test_a_restored_trial_resumes_from_the_checkpoint_tune_hands_back(tmp_path):
    """Tune's experiment resume gives the trial its last checkpoint: it becomes the run's latest."""
    from ray_elastic.checkpoint import CheckpointStore
    from ray_elastic.tune.trial import _adopt_tunes_checkpoint

    reported = CheckpointStore(str(tmp_path / "first")).write({"step": 30, "w": 2.5}, {"commit": 30})
    persisted = tune.Checkpoint.from_directory(reported)  # what Tune kept and hands back
    store = CheckpointStore(str(tmp_path / "trial"))
    store.write({"step": 5, "w": 0.1}, {"commit": 5})  # an older one the trial's directory still holds
    _adopt_tunes_checkpoint(store, persisted)
    assert store.meta()["commit"] == 30 and store.read()[0] == {"step": 30, "w": 2.5}


class FakeTune:
    """Stands in for `tune.report` in the trial's process: records what each report carried."""

    def __init__(self, copy=None) -> None:
        self.reports: list[tuple[dict, object]] = []
        self.copy = copy  # what Tune does with a checkpoint it is handed (copy it), or None

    def __call__(self, metrics, checkpoint=None) -> None:
        if checkpoint is not None and self.copy is not None:
            self.copy(checkpoint)
        self.reports.append((metrics, checkpoint))


@pytest.fixture
def relay_parts(tmp_path, monkeypatch):
    import ray_elastic.tune.trial as trial
    from ray_elastic.checkpoint import CheckpointStore

    monkeypatch.setattr(trial, "_CHECKPOINT_LOOK_S", 0.0)
    fake = FakeTune()
    monkeypatch.setattr(tune, "report", fake)
    return trial, CheckpointStore(str(tmp_path / "trial"), keep=1), fake


def test_the_checkpoint_handed_to_tune_is_not_pruned_while_tune_copies_it(relay_parts):
    trial, store, fake = relay_parts
    store.write({"step": 10}, {"generation": 1, "commit": 10, "committed_at": 1.0})
    copied = []

    def copy(checkpoint):
        # rank 0 goes on writing while Tune copies: with keep=1 each write prunes the older ones
        store.write({"step": 20}, {"generation": 1, "commit": 20, "committed_at": 2.0})
        store.write({"step": 30}, {"generation": 1, "commit": 30, "committed_at": 3.0})
        copied.append(elastic.load_checkpoint(checkpoint.path)["step"])

    fake.copy = copy
    trial._Relay(store)({"step": 10}, 1.5)
    assert copied == [10], "Tune copied the checkpoint it was handed, whole"
    store.write({"step": 40}, {"generation": 1, "commit": 40, "committed_at": 4.0})
    assert [store.read(p)[0]["step"] for p in store.checkpoints()] == [40], "unpinned once Tune's copy returned"


def test_the_checkpoint_handed_to_tune_is_the_one_its_report_saw(relay_parts):
    trial, store, fake = relay_parts
    store.keep = 3
    store.write({"step": 10}, {"generation": 1, "commit": 10, "committed_at": 100.0})
    store.write({"step": 20}, {"generation": 1, "commit": 20, "committed_at": 200.0})
    relay = trial._Relay(store)
    relay({"step": 15}, 150.0)  # reported between the two commits: the second holds later state
    relay({"step": 16}, 160.0)  # nothing new before it
    relay({"step": 25}, 250.0)
    handed = [None if c is None else elastic.load_checkpoint(c.path)["step"] for _, c in fake.reports]
    assert handed == [10, None, 20]
    assert [m["step"] for m, _ in fake.reports] == [15, 16, 25]


def test_a_burst_of_reports_hands_over_the_checkpoint_its_later_reports_saw(relay_parts, monkeypatch):
    """fit() fetches reports in bursts; the store is listed once a second, at the burst's first (oldest) report."""
    trial, store, fake = relay_parts
    monkeypatch.setattr(trial, "_CHECKPOINT_LOOK_S", 3600.0)  # one listing for the whole burst
    store.keep = 3
    store.write({"step": 5}, {"generation": 1, "commit": 5, "committed_at": 50.0})
    store.write({"step": 10}, {"generation": 1, "commit": 10, "committed_at": 100.0})
    relay = trial._Relay(store)
    for step in (6, 11, 12):  # one burst: the first report predates the commit of step 10, the next ones do not
        relay({"step": step}, step * 10.0 + 5)
    handed = [None if c is None else elastic.load_checkpoint(c.path)["step"] for _, c in fake.reports]
    assert handed == [5, 10, None], "the checkpoint of step 10 went with the first report that saw it"


def test_a_hand_over_that_hangs_fails_the_trial_naming_the_checkpoint(relay_parts, monkeypatch):
    import threading

    trial, store, fake = relay_parts
    path = store.write({"step": 10}, {"generation": 1, "commit": 10, "committed_at": 1.0})
    mount_back = threading.Event()
    fake.copy = lambda checkpoint: mount_back.wait(60)  # Tune's copy from a dead mount
    relay = trial._Relay(store, handover_s=0.5)
    outcome: list[BaseException | None] = []

    def report():
        try:
            relay({"step": 10}, 2.0)
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - what fit() would get
            outcome.append(e)

    caller = threading.Thread(target=report, daemon=True)
    started = time.monotonic()
    caller.start()
    caller.join(10)
    mount_back.set()
    assert not caller.is_alive(), "the hand-over hung past its bound"
    assert time.monotonic() - started < 5
    (error,) = outcome
    assert isinstance(error, elastic.checkpoint.CheckpointError), error
    assert os.path.basename(path) in str(error) and "tune.report" in str(error) and "0.5 s" in str(error)
