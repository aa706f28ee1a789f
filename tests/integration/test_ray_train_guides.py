"""Ray Train's documented scripts by their imports: the checkpoint guide's intentional error, Ray Data's list and
tensor columns, `get_context()`'s fields and `Result` inspected as the key-concepts page does.

One run of the checkpoint guide's loop (support/ray_train_guides.py) on the session's cluster: every rank raises
once after epoch 1 under `FailureConfig(max_failures=1)` (one failure of the run: nobody is killed, every rank
re-enters in its own process from epoch 1's checkpoint), then rank 1 is SIGKILLed in epoch 2 and a node is
added. A second, short run with `max_failures=0` fails as Ray's does, caught as `ray.train.TrainingFailedError`.
"""

from __future__ import annotations

import json

import pytest
from conftest import wait_until

pytest.importorskip("ray.train")
pytest.importorskip("ray.data")

import ray.train  # noqa: E402
from ray_train_guides import FEATURES, ROWS, checkpoint_guide_trainer  # noqa: E402
from runs import fit_in_thread  # noqa: E402


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_checkpoint_guides_error_on_every_rank_is_one_failure_then_a_kill_and_a_node_added(
    cluster, no_leaks, tmp_path
):
    log, marker = tmp_path / "log.jsonl", tmp_path / "killed"
    config = {"lr": 0.05, "epochs": 10, "batch_size": 4, "raise_after_epoch": 1, "step_sleep": 0.15, "log": str(log)}
    config["kill"] = {"at": [2, 3], "rank": 1, "marker": str(marker)}
    fut = fit_in_thread(checkpoint_guide_trainer(config, (2, 4), str(tmp_path / "runs"), name="guide"))
    node = None
    try:
        wait_until(lambda: marker.exists() or fut.done(), 120, "rank 1 to SIGKILL itself in epoch 2")
        assert not fut.done(), fut.exception()
        node = cluster.add_node(num_cpus=2)
        result = fut.result(timeout=150)
    finally:
        if node is not None:
            cluster.remove_node(node)
    records = _records(log)
    entries = [r for r in records if r.get("entry")]
    first = [e for e in entries if e["start_epoch"] == 0]
    again = [e for e in entries if e["start_epoch"] == 2]
    pids = {e["pid"] for e in first}
    world = len(first)  # 3 or 4: the Ray Data feed actor takes a CPU of the cluster's 4
    assert world >= 3 and len(pids) == world, entries
    # the intentional error: every rank re-entered in its own process, from epoch 1's checkpoint
    killed_at = marker.stat().st_mtime
    reentered = {e["pid"] for e in again if e["time"] < killed_at}
    assert reentered == pids, f"a rank was replaced for raising: {entries}"
    # the kill: the three survivors re-enter in their processes, a worker on the new node joins
    after_kill = {e["pid"] for e in entries if e["time"] > killed_at}
    assert len(after_kill & pids) == world - 1 and after_kill - pids, entries
    killed_pid = int(marker.read_text())
    assert killed_pid in pids and killed_pid not in after_kill

    # get_context(): the fields as Ray Train gives them
    for e in entries:
        assert 0 <= e["world_rank"] < e["world_size"] <= 4 and e["experiment"] == "guide", e
        assert 0 <= e["local_rank"] < e["local_world_size"] <= 2 and e["node_rank"] >= 0, e
    assert {e["world_rank"] for e in first} == set(range(world))

    # Ray Data: the list column stacked, the tensor column kept, the dtypes as asked
    batches = [r for r in records if "batch" in r]
    for r in batches:
        b = r["batch"]
        n = b["label"][1][0]
        assert b["features"] == ["torch.float32", [n, FEATURES]] and b["grid"] == ["torch.float32", [n, 2, 2]], b
        assert b["label"] == ["torch.float64", [n]] and b["id"] == ["torch.int64", [n]], b
    last_epoch = [r for r in batches if r["epoch"] == config["epochs"] - 1]
    assert sorted(i for r in last_epoch for i in r["ids"]) == list(range(ROWS)), "the last epoch: every row once"

    # Result, inspected as the key-concepts page does
    [retried] = [e for e in result.elastic.events if e.kind == "reset_requested"]
    assert "Intentional error" in retried.detail and "retry 1 of max_failures=1" in retried.detail
    assert result.error is None and result.metrics["epoch"] == config["epochs"] - 1
    assert result.path.endswith("guide") and result.filesystem is not None
    with result.checkpoint.as_directory() as d:
        import torch

        assert torch.load(f"{d}/model.pt")["epoch"] == config["epochs"] - 1
    frame = result.metrics_dataframe
    assert "loss" in frame.columns and frame["epoch"].max() == config["epochs"] - 1
    assert result.best_checkpoints and result.best_checkpoints[-1][0].path == result.checkpoint.path
    from ray_elastic.train import Result

    restored = Result.from_path(result.path)
    assert restored.checkpoint.path == result.checkpoint.path
    assert restored.metrics["epoch"] == config["epochs"] - 1


def test_without_retries_the_guides_error_fails_the_run_as_ray_trains_does(cluster, no_leaks, tmp_path):
    config = {"lr": 0.05, "epochs": 3, "batch_size": 8, "raise_after_epoch": 0, "log": str(tmp_path / "log.jsonl")}
    with pytest.raises(ray.train.TrainingFailedError, match="Intentional error to showcase restoration") as info:
        checkpoint_guide_trainer(config, 2, str(tmp_path / "runs"), name="no-retries", max_failures=0).fit()
    import ray_elastic

    assert isinstance(info.value, ray_elastic.TrainingFailedError)


def test_a_plain_loop_under_data_parallel_trainer_reads_an_unsplit_dataset_whole_through_a_kill(
    cluster, no_leaks, tmp_path
):
    """The key-concepts page's generic trainer: "valid", left out of `datasets_to_split`, is read whole by every
    rank, before and after a SIGKILL; the survivor re-enters in its process and sees the checkpoints kept."""
    from ray_train_guides import fit_key_concepts

    log, marker = tmp_path / "log.jsonl", tmp_path / "killed"
    config = {"epochs": 4, "step_sleep": 0.05, "log": str(log), "kill": {"epoch": 2, "rank": 1, "marker": str(marker)}}
    result = fit_key_concepts(config, 2, str(tmp_path / "runs"))
    records = _records(log)
    assert marker.exists()
    entries = [r for r in records if r.get("entry")]
    killed_pid = int(marker.read_text())
    first = {e["pid"] for e in entries if e["start_epoch"] == 0}
    again = [e for e in entries if e["start_epoch"] == 2]
    assert {e["pid"] for e in again} & first - {killed_pid}, f"the survivor re-entered in its own process: {entries}"
    assert all(len(e["kept"]) == 2 for e in again), f"get_all_reported_checkpoints after the re-entry: {again}"
    valid = [r for r in records if "valid" in r]
    assert valid and all(r["valid"] == list(range(16)) for r in valid), "every rank reads the unsplit dataset whole"
    for epoch in range(config["epochs"]):  # the split dataset: each epoch's rows once over the ranks (no kill there)
        if epoch != 2:
            ids = sorted(i for r in records if r.get("epoch") == epoch and "ids" in r for i in r["ids"])
            assert ids == list(range(ROWS)), f"epoch {epoch}: {ids}"
    assert result.metrics["epoch"] == config["epochs"] - 1
