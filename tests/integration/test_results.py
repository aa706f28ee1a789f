"""On a real local cluster: what `fit()` hands back, as users pass it.

`report()` and `train_fn`'s return value, with the mistakes a user makes:
each either works or fails with a clear error (issue "Nothing lost while
fit() says success", item 5 and 11). Each case failed before the fix: an
unpicklable return value passed for rank 0 dying, an unpicklable metric
killed the metrics thread, reports before `@run` vanished.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import ray
from conftest import run_namespaces_alive
from runs import start_and_reach_step

import ray_elastic as elastic
from ray_elastic import ElasticTrainer, TrainingFailedError

pytestmark = pytest.mark.integration


def _reporting_train_fn(config):
    elastic.report({"phase": "setup"})  # before the worker has a rank: must not vanish
    refused = []

    @elastic.run
    def train(state):
        history = []
        while state.step < config["steps"]:
            state.step += 1
            history.append(state.step)
            elastic.report({"step": state.step, "history": history})
            history.append(-1)  # mutated after the report: the reported value must not change
            history.pop()
            if state.step == 3:
                try:
                    elastic.report({"step": -1, "lock": threading.Lock()})
                except TypeError as e:
                    refused.append(str(e))
            state.commit()
        return {"refused": refused}

    return train(elastic.ObjectState(step=0))


def test_reports_are_deep_copies_checked_at_the_call_and_kept_from_before_run(cluster, no_leaks):
    fetched: list[tuple[str, dict]] = []
    fit_thread = threading.current_thread().name
    result = ElasticTrainer(_reporting_train_fn, 2, 2, config={"steps": 12}, verbose=0).fit(
        on_report=lambda m: fetched.append((threading.current_thread().name, m))
    )
    assert [m for _, m in fetched] == result.metrics_history, "on_report sees every report once, in order"
    assert {name for name, _ in fetched} == {fit_thread}, "on_report runs in the thread that called fit()"
    assert result.metrics_history[0] == {"phase": "setup"}
    steps = result.metrics_history[1:]
    assert [m["step"] for m in steps] == list(range(1, 13)), "a refused metric must not stop the later ones"
    assert all(m["history"] == list(range(1, m["step"] + 1)) for m in steps), "reports are snapshots"
    (refused,) = result.return_value["refused"]
    assert "the value of 'lock' (lock) cannot be pickled" in refused


def _endless_reporting_train_fn(config):
    @elastic.run
    def train(state):
        while True:
            state.step += 1
            elastic.report({"step": state.step})
            state.commit()
            time.sleep(0.01)

    return train(elastic.ObjectState(step=0))


class _FullQueue(Exception):
    pass


def test_an_on_report_that_raises_stops_the_run_and_leaves_nothing_behind(cluster, no_leaks):
    def on_report(metrics):
        if metrics["step"] >= 5:
            raise _FullQueue("the callback cannot take more")

    with pytest.raises(_FullQueue, match="cannot take more"):
        ElasticTrainer(_endless_reporting_train_fn, 2, 2, verbose=0).fit(on_report=on_report)
    # no_leaks: the endless run's actors and placement groups are gone


def test_on_report_must_be_callable(cluster):
    with pytest.raises(ValueError, match="on_report must be callable"):
        ElasticTrainer(_endless_reporting_train_fn, 2, 2, verbose=0).fit(on_report="print")


def _unpicklable_return_train_fn(config):
    @elastic.run
    def train(state):
        for _ in range(3):
            state.step += 1
            state.commit()
        return threading.Lock()

    return train(elastic.ObjectState(step=0))


def _never_joins_train_fn(config):
    elastic.report({"loss": 1.0})
    return "trained?"


class _UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")


def _unprintable_error_train_fn(config):
    @elastic.run
    def train(state):
        raise _UnprintableError()

    return train(elastic.ObjectState(step=0))


@pytest.mark.parametrize(
    ("train_fn", "max_failures", "says"),
    [
        (_unpicklable_return_train_fn, 2, r"return value on rank 0 \(lock\) cannot be pickled"),
        (_never_joins_train_fn, 2, "train_fn returned without joining the ring"),
        (_unprintable_error_train_fn, 0, r"_UnprintableError: <str\(\) of the exception raised RuntimeError>"),
    ],
    ids=["unpicklable-return", "never-joined", "unprintable-exception"],
)
def test_user_mistakes_end_the_run_at_once_with_a_clear_error(cluster, no_leaks, train_fn, max_failures, says):
    """Retries allowed or not: running again would repeat the mistake, and no node is at fault."""
    started = time.monotonic()
    with pytest.raises(TrainingFailedError, match=says) as info:
        ElasticTrainer(train_fn, 2, 2, max_failures=max_failures, verbose=0).fit()
    assert time.monotonic() - started < 60, "no retry, no cool-down, no elastic_timeout waited out"
    assert "died" not in str(info.value) and "min_workers not reached" not in str(info.value)


def _replace_with_a_file(path: Path, deadline_s: float = 30.0) -> None:
    """`path` becomes a plain file, although the background checkpoint writer may be writing into it."""
    deadline = time.monotonic() + deadline_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} could not be replaced by a file within {deadline_s} s")
        shutil.rmtree(path, ignore_errors=True)
        try:
            path.write_text("not a directory any more")
        except IsADirectoryError:  # the writer made it again: go round
            pass


def _storage_lost_train_fn(config):
    @elastic.run
    def train(state):
        while state.step < 8:
            state.step += 1
            if state.step == 8 and elastic.rank() == 0:  # the storage goes away before the last commit
                _replace_with_a_file(Path(config["ckpt"]))
            state.commit()
        return "trained"

    return train(elastic.ObjectState(step=0))


def test_a_checkpoint_that_cannot_be_written_at_the_end_is_said_in_the_result(cluster, no_leaks, tmp_path):
    """Found trying it: a failed final flush threw train_fn's return value away after training finished."""
    ckpt = tmp_path / "ckpt"
    result = ElasticTrainer(
        _storage_lost_train_fn,
        2,
        2,
        config={"ckpt": str(ckpt)},
        checkpoint_dir=str(ckpt),
        checkpoint_every=1,
        verbose=0,
    ).fit()
    assert result.return_value == "trained"
    assert result.checkpoint_error is not None and "failed" in result.checkpoint_error, result.checkpoint_error


def test_another_job_cannot_read_inject_or_steer_a_run(cluster, no_leaks, tmp_path):
    """Ray has no per-job authentication: a run's actors refuse every call without the run's secret token."""
    fut = start_and_reach_step(tmp_path, config={"steps": 120}, min_workers=2, max_workers=2)
    [driver_entry] = [a for a in run_namespaces_alive() if a["name"] == "driver"]
    namespace = driver_entry["namespace"]
    driver = ray.get_actor("driver", namespace=namespace)
    attempts = {
        "inject metrics": driver.add_metrics.remote("w1", [(time.time(), {"step": -1, "injected": True})]),
        "read metrics": driver.status.remote(0),
        "publish a generation": ray.get_actor("kv", namespace=namespace).publish.remote(99, {}),
        "tell a worker to leave": ray.get_actor("w1", namespace=namespace).notify.remote(99),
    }
    for what, ref in attempts.items():
        with pytest.raises(PermissionError, match="without this run's token"):
            ray.get(ref, timeout=30)
            pytest.fail(f"another job could {what}")
    result = fut.result(timeout=120)
    assert not [m for m in result.metrics_history if m.get("injected")]
    assert [e.kind for e in result.events] == ["start"] and result.metrics_history[-1]["step"] == 120
