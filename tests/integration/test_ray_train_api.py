"""A Ray Train v2 script with only its imports changed, on the session's cluster, through a SIGKILL and a node added.

The script (support/ray_train_script.py) is in the Fashion-MNIST guide's
shape: a prepared test loader evaluated every epoch, a checkpoint passed to
`ray.train.report` (fully qualified) and resumed from `get_checkpoint()`.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import Future

import pytest
from conftest import wait_until

pytest.importorskip("ray.train")

from ray_train_script import NUM_TRAIN, train_fashion_mnist  # noqa: E402


def _fit_in_thread(**kwargs) -> Future:
    fut: Future = Future()

    def target() -> None:
        try:
            fut.set_result(train_fashion_mnist(**kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            fut.set_exception(e)

    threading.Thread(target=target, daemon=True).start()
    return fut


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _surviving_steps(records: list[dict]) -> list[dict]:
    """The steps no rollback undid: a step counts unless a later entry resumed from a checkpoint before it."""
    entries = [r for r in records if r.get("entry")]
    return [r for r in records if "ids" in r and all(r["step"] <= e["at"][1] for e in entries if e["time"] > r["time"])]


def test_a_ray_train_script_recovers_in_place_through_a_kill_and_grows_onto_a_new_node(cluster, no_leaks, tmp_path):
    log, marker = tmp_path / "log.jsonl", tmp_path / "killed"
    config = {
        "lr": 0.05,
        "epochs": 8,
        "batch_size_per_worker": 4,
        "checkpoint_every": 2,
        "step_sleep": 0.15,
        "log": str(log),
        "kill": {"at": [1, 8], "rank": 1, "marker": str(marker)},
    }
    fut = _fit_in_thread(config=config, num_workers=(2, 4), storage_path=str(tmp_path / "runs"))
    node = None
    try:
        wait_until(lambda: marker.exists() or fut.done(), 90, "rank 1 to SIGKILL itself at epoch 1, step 8")
        assert not fut.done(), fut.exception()
        killed_at = marker.stat().st_mtime
        before = {r["pid"] for r in _records(log) if r.get("entry") and r["time"] < killed_at}
        node = cluster.add_node(num_cpus=2)
        result = fut.result(timeout=120)
    finally:
        if node is not None:
            cluster.remove_node(node)
    records = _records(log)
    entries = [r for r in records if r.get("entry")]
    after = {r["pid"] for r in entries if r["time"] > killed_at}
    survivors = before & after
    assert len(before) == 4 and len(survivors) == 3, f"survivors re-enter in their own processes: {entries}"
    assert after - before, "a worker on the added node joined and trained"
    assert all(e["experiment"] == "fashion" for e in entries)

    steps = _surviving_steps(records)
    for epoch in range(config["epochs"]):
        seen = Counter(i for r in steps if r["epoch"] == epoch for i in r["ids"])
        assert set(seen) == set(range(NUM_TRAIN)), f"epoch {epoch}: never trained {set(range(NUM_TRAIN)) - set(seen)}"
        assert sum(seen.values()) - NUM_TRAIN <= 3 * 3, f"epoch {epoch}: more repeats than padding: {seen}"

    last_tests = [r for r in records if r.get("test") == config["epochs"] - 1]
    assert len({r["digest"] for r in last_tests}) == 1, f"the ranks end with different models: {last_tests}"
    evals = [m for m in result.elastic.metrics_history if "accuracy" in m]
    assert evals[-1]["loss"] < evals[0]["loss"], f"the test loss did not fall: {evals}"
    assert result.metrics["epoch"] == config["epochs"] - 1
    with result.checkpoint.as_directory() as d:
        import torch

        assert torch.load(f"{d}/checkpoint.pt")["epoch"] == config["epochs"]


def test_a_fixed_world_recovers_in_place_through_fully_qualified_calls(cluster, no_leaks, tmp_path):
    """num_workers=int: the lost worker is replaced, the survivors never leave their processes.

    Rank 0, which wrote every checkpoint, dies inside a report: the others
    still hold its last one. The loop prepares through `ray.train.torch.*`
    and wraps its reports in `except Exception`, which must not swallow the
    run's interrupt.
    """
    log, marker = tmp_path / "log.jsonl", tmp_path / "killed"
    config = {
        "lr": 0.05,
        "epochs": 3,
        "batch_size_per_worker": 4,
        "checkpoint_every": 2,
        "log": str(log),
        "fully_qualified": True,
        "kill": {"at": [1, 10], "where": "report", "rank": 0, "marker": str(marker)},
    }
    result = train_fashion_mnist(config=config, num_workers=3, storage_path=str(tmp_path / "runs"), name="fixed")
    records = _records(log)
    killed_at = marker.stat().st_mtime
    entries = [r for r in records if r.get("entry")]
    before = {r["pid"] for r in entries if r["time"] < killed_at}
    after = [r for r in entries if r["time"] > killed_at]
    assert len(before) == 3 and len(before & {r["pid"] for r in after}) == 2, f"survivors kept: {entries}"
    assert {r["size"] for r in after} == {3}, f"a fixed world trains at its size only: {after}"
    assert all(r["at"] == [1, 8] for r in after), f"all resume from rank 0's last checkpoint (step 8): {after}"
    assert not [r for r in records if "swallowed" in r], "the user's except Exception caught the run's interrupt"
    steps = _surviving_steps(records)
    for epoch in range(config["epochs"]):
        seen = Counter(i for r in steps if r["epoch"] == epoch for i in r["ids"])
        assert set(seen) == set(range(NUM_TRAIN)) and sum(seen.values()) - NUM_TRAIN <= 2 * 2, (epoch, seen)
    assert result.metrics["epoch"] == config["epochs"] - 1
    assert result.path.endswith("fixed") and result.checkpoint is not None


def test_get_dataset_shard_passes_are_epochs_of_every_row_once_through_a_sigkill(cluster, no_leaks, tmp_path):
    """A Ray Dataset given to `TorchTrainer(datasets=)`: each `iter_torch_batches` call is one whole epoch.

    Rank 1 is SIGKILLed after 2 of epoch 1's 4 batches. The survivor re-enters its loop in its own process from
    epoch 0's checkpoint, a replacement joins, and epoch 1 is trained again from its start: what counts is every
    epoch's rows exactly once, the rolled-back attempts' rows left out.
    """
    ray_data = pytest.importorskip("ray.data")
    from ray_train_script import train_func_on_a_dataset

    from ray_elastic.train import RunConfig, ScalingConfig
    from ray_elastic.train.torch import TorchTrainer

    log, marker = tmp_path / "log.jsonl", tmp_path / "killed"
    config = {"epochs": 3, "batch_size": 8, "log": str(log), "kill": {"at": [1, 2], "rank": 1, "marker": str(marker)}}
    TorchTrainer(
        train_func_on_a_dataset,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="data", storage_path=str(tmp_path / "runs")),
        datasets={"train": ray_data.range(64)},
    ).fit()
    assert marker.exists()
    records = _records(log)
    entries = [r for r in records if r.get("entry")]
    first, again = entries[:2], entries[2:]
    assert again and {e["start_epoch"] for e in again} == {1}, f"the loops entered after the kill: {entries}"
    survivors = {e["pid"] for e in first} & {e["pid"] for e in again}
    assert survivors, "the survivor did not re-enter in its own process"
    killed = {e["pid"] for e in first} - survivors
    last = {e["pid"]: e["attempt"] for e in entries}  # each process's last entry into the loop
    for epoch in range(config["epochs"]):
        # epoch 0 was reported before the kill; later epochs count the last attempts of the living processes
        kept = [
            r
            for r in records
            if r.get("epoch") == epoch and (epoch < 1 or (r["pid"] not in killed and r["attempt"] == last[r["pid"]]))
        ]
        seen = Counter(i for r in kept for i in r["ids"])
        assert seen == Counter(range(64)), f"epoch {epoch}: {seen}"
