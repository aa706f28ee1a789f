"""Ray Tune trials that are elastic runs, on a real cluster (a head and two 2-CPU nodes).

- ASHA over 3 trials of 1-2 workers: some trials stopped early, the best
  found, its checkpoint opened, Tune's TensorBoard logger's event file read
  back with the reported losses, nothing left behind (actors, placement
  groups: the trials' reservations and growth included).
- Tune's resume of an experiment (`Tuner.restore(..., resume_errored=True)`):
  the trial failed midway goes on from the checkpoint Tune holds, not from step 1.
- A worker SIGKILLed inside a trial that grew to 2 workers: Tune sees one
  trial, never restarted (one trainable process), whose steps go on 1, 2, 3
  ... without a gap or a repeat.
- A trial with a hot spare (`spares=1`): the trial grows room for it beyond
  its reservation, the spare boots there, and a member's SIGKILL is filled by
  it: the trial never trains short-handed and no boot is on the critical path.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import run_namespaces_alive, run_placement_groups_alive, wait_until
from runs import fit_in_thread
from spare_loop import booted, new_boot, spare_train_fn, steps

import ray_elastic as elastic
from ray_elastic import ElasticTrainer

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


def _tensorboard_scalars(trial_dir: str, tag: str) -> list[float]:
    """The values of scalar `tag` in the trial's TensorBoard event file (TFRecord framing, tensorboardX's proto)."""
    from tensorboardX.proto import event_pb2

    (path,) = Path(trial_dir).glob("events.out.tfevents.*")
    data, values, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
        at += 12 + length + 4
        values += [v.simple_value for v in event.summary.value if v.tag == tag]
    return values


def _placement_groups_left() -> list[str]:
    from ray.util.placement_group import placement_group_table

    return [f"{i['name'] or pg}: {i['state']}" for pg, i in placement_group_table().items() if i["state"] != "REMOVED"]


def _wait_for_every_placement_group_removed(timeout: float = 60) -> None:
    """Every placement group gone: each trial's reservation (Tune's) and what its run grew into (the driver's)."""
    deadline = time.monotonic() + timeout
    while _placement_groups_left():
        assert time.monotonic() < deadline, f"placement groups left after {timeout:g} s: {_placement_groups_left()}"
        time.sleep(0.1)


@pytest.mark.integration
def test_asha_over_elastic_trials_stops_some_finds_the_best_and_leaves_nothing(cluster, no_leaks, tmp_path):
    from ray.tune.logger import TBXLoggerCallback
    from ray.tune.schedulers import ASHAScheduler

    trainer = ElasticTrainer(
        quadratic_train_fn,
        min_workers=1,
        max_workers=2,
        config={"steps": 40, "step_s": 0.05},
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=5,
        verbose=0,
    )
    started = time.monotonic()
    grid = tune.Tuner(
        trainer.as_trainable(),
        # two at a time, the better two first: the last one starts when one of them ended, so it reaches each
        # rung behind a better result, and ASHA stops it whatever the order the first two arrive in
        param_space={"lr": tune.grid_search([0.2, 0.03, 0.002])},
        tune_config=tune.TuneConfig(
            metric="loss",
            mode="min",
            scheduler=ASHAScheduler(max_t=40, grace_period=8, reduction_factor=2),
            max_concurrent_trials=2,
        ),
        run_config=tune.RunConfig(
            name="asha", storage_path=str(tmp_path / "tune"), callbacks=[TBXLoggerCallback()], verbose=0
        ),
    ).fit()
    print(f"3 elastic trials under ASHA in {time.monotonic() - started:.1f} s")
    assert grid.num_errors == 0, [r.error for r in grid if r.error]
    lengths = {r.config["lr"]: len(r.metrics_dataframe) for r in grid}
    assert lengths[0.2] >= 40 and lengths[0.002] < 40, f"ASHA did not stop the worst trial early: {lengths}"
    best = grid.get_best_result()
    assert best.config["lr"] == 0.2 and best.metrics["loss"] < 1e-6
    frame = best.metrics_dataframe
    assert list(frame["step"]) == list(range(1, len(frame) + 1))

    # the best trial's checkpoints are Tune's, and hold plain values users open
    assert best.checkpoint is not None
    assert elastic.load_checkpoint(best.checkpoint)["w"] == pytest.approx(3.0, abs=1e-3)

    # Tune's own TensorBoard logger, unchanged: the event file holds the losses rank 0 reported
    logged = _tensorboard_scalars(best.path, "ray/tune/loss")
    assert logged == pytest.approx(list(frame["loss"]), rel=1e-6, abs=1e-12)

    # nothing left: the runs' actors and groups (no_leaks), and every trial's reservation and growth
    _wait_for_every_placement_group_removed()
    assert not run_namespaces_alive() and not run_placement_groups_alive()


@pytest.mark.integration
def test_a_worker_sigkilled_inside_a_trial_is_recovered_in_place(cluster, no_leaks, tmp_path):
    marker = tmp_path / "killed"
    trainer = ElasticTrainer(
        quadratic_train_fn,
        min_workers=1,
        max_workers=2,
        config={"steps": 400, "step_s": 0.05, "marker": str(marker), "kill_after": 5, "steps_after_kill": 30},
        cooldown_range=(0.5, 1.0),
        verbose=0,
    )
    grid = tune.Tuner(
        trainer.as_trainable(),
        param_space={"lr": 0.01},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(
            name="sigkill", storage_path=str(tmp_path / "tune"), failure_config=tune.FailureConfig(max_failures=0)
        ),
    ).fit()
    assert grid.num_errors == 0, [r.error for r in grid if r.error]
    assert marker.exists(), "the trial never grew to 2 workers, so no worker was killed"
    (result,) = list(grid)
    frame = result.metrics_dataframe
    assert list(frame["step"]) == list(range(1, len(frame) + 1)), "a step was lost or repeated"
    assert list(frame["training_iteration"]) == list(range(1, len(frame) + 1))
    assert frame["pid"].nunique() == 1, "the trial was restarted (a new trainable process)"
    worlds = list(frame["world"])
    grown = worlds.index(2)
    assert 1 in worlds[grown:], f"the world never shrank after the kill: {worlds}"
    assert len(frame) < 400
    _wait_for_every_placement_group_removed()


@pytest.mark.integration
def test_tunes_resume_of_an_experiment_resumes_the_trial_from_its_checkpoint(cluster, no_leaks, tmp_path):
    """A trial failed midway; Tuner.restore restarts it from the last checkpoint Tune holds, not from step 1."""
    trainer = ElasticTrainer(
        quadratic_train_fn,
        min_workers=1,
        max_workers=1,
        config={"steps": 45, "step_s": 0.1, "fail_at": 30, "fail_marker": str(tmp_path / "failed")},
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=5,
        verbose=0,
    )
    storage = str(tmp_path / "tune")
    run_config = tune.RunConfig(name="resume", storage_path=storage, verbose=0)
    first = tune.Tuner(
        trainer.as_trainable(),
        param_space={"lr": 0.01},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=run_config,
    ).fit()
    assert first.num_errors == 1 and "interrupted here" in str(first[0].error)
    held = first[0].checkpoint
    assert held is not None, "the failed trial handed Tune no checkpoint"
    held_step = elastic.load_checkpoint(held)["step"]
    assert 10 <= held_step <= 30

    restored = tune.Tuner.restore(f"{storage}/resume", trainer.as_trainable(), resume_errored=True).fit()
    assert restored.num_errors == 0, [r.error for r in restored if r.error]
    frame = restored[0].metrics_dataframe
    assert frame["step"].iloc[-1] == 45
    second = frame[frame["pid"] == frame["pid"].iloc[-1]]  # the rows of the restored trial's own process
    assert second["step"].iloc[0] == held_step + 1, f"the restored trial began at step {second['step'].iloc[0]}"
    _wait_for_every_placement_group_removed()


@pytest.mark.integration
def test_a_trials_hot_spare_boots_in_room_beyond_its_reservation_and_fills_a_killed_members_place(
    cluster, no_leaks, tmp_path
):
    trainer = ElasticTrainer(
        spare_train_fn, min_workers=2, max_workers=2, spares=1, config={"dir": str(tmp_path)}, verbose=0
    )
    tuner = tune.Tuner(
        trainer.as_trainable(), run_config=tune.RunConfig(name="spare", storage_path=str(tmp_path / "tune"), verbose=0)
    )
    fut = fit_in_thread(tuner)
    try:
        wait_until(lambda: len({s["pid"] for s in steps(tmp_path)}) == 2 or fut.done(), 120, "2 members to train")
        members = {s["pid"] for s in steps(tmp_path)}
        assert len(members) == 2, fut.result() if fut.done() else members
        # the reservation holds the 2 members: the spare needs room the trial grows into beside it
        spare = new_boot(tmp_path, members, "the trial's hot spare to boot")
        generation = max(s["generation"] for s in steps(tmp_path))
        victim = min(members)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: any(s["generation"] > generation for s in steps(tmp_path)), 60, "a step after the kill")
        after = [s for s in steps(tmp_path) if s["generation"] > generation]
        wait_until(lambda: spare in {s["pid"] for s in steps(tmp_path)}, 60, "the spare to train")
    finally:
        (tmp_path / "stop").touch()
    grid = fut.result(timeout=120)
    assert grid.num_errors == 0, [r.error for r in grid if r.error]
    trained = steps(tmp_path)
    first = min(s["generation"] for s in after)
    assert {s["pid"] for s in trained if s["generation"] == first} == (members - {victim}) | {spare}
    assert booted(tmp_path)[spare] < killed_at, "the spare's boot was on the critical path"
    assert {s["size"] for s in trained} == {2}, "the trial trained short-handed"
    (result,) = list(grid)
    assert result.metrics["world"] == 2 and result.metrics["step"] == max(s["step"] for s in trained)
    _wait_for_every_placement_group_removed()
