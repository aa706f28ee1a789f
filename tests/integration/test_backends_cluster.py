"""Backends through `fit()` on the session's cluster: GPU workers refused on a cluster without GPUs, the
numpy example trained through a worker's SIGKILL on every CPU backend this venv can run, and mismatched
collectives failing the run at once with each rank's arguments named.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from conftest import run_namespaces_alive

import ray_elastic as elastic
from ray_elastic import ElasticTrainer, TrainingFailedError
from ray_elastic.collective import CollectiveMismatchError

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import linear_regression  # noqa: E402

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_PYGLOO = importlib.util.find_spec("pygloo") is not None
NO_PYGLOO = "pygloo is not installed: it has wheels for Python <= 3.10 (make test-pygloo)"


def noop(config: dict) -> None:
    return None


@pytest.mark.integration
@pytest.mark.skipif(not HAS_TORCH, reason="NCCL runs through torch, which this venv lacks")
def test_gpu_workers_on_a_cluster_without_gpus_fail_at_fit_before_spawning(cluster, no_leaks):
    if ray.cluster_resources().get("GPU", 0) > 0:
        pytest.skip("this cluster has GPUs: the error cannot happen")
    before = ray.util.list_named_actors(all_namespaces=True)
    trainer = ElasticTrainer(noop, 1, 1, resources_per_worker={"CPU": 1, "GPU": 1}, verbose=0)
    start = time.monotonic()
    with pytest.raises(ValueError, match="no node of the Ray cluster has one"):
        trainer.fit()
    assert time.monotonic() - start < 10
    assert ray.util.list_named_actors(all_namespaces=True) == before
    assert not run_namespaces_alive()


def kill_once(marker: str, rank: int, step: int):
    """A step hook: rank `rank` SIGKILLs itself at `step`, once across all workers (the marker says who did)."""

    def hook(at: int) -> None:
        if at != step or elastic.rank() != rank:
            return
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    return hook


@pytest.mark.integration
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("gloo", marks=pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed in this venv")),
        pytest.param("pygloo", marks=pytest.mark.skipif(not HAS_PYGLOO, reason=NO_PYGLOO)),
    ],
)
def test_numpy_example_trains_through_a_sigkill(cluster, no_leaks, tmp_path, backend):
    marker = tmp_path / "killed"
    steps = 60
    result = ElasticTrainer(
        linear_regression.train_fn,
        min_workers=2,
        max_workers=3,
        config={"steps": steps, "lr": 0.05, "commit_every": 5, "step_hook": kill_once(str(marker), 1, 12)},
        backend=backend,
        cooldown_range=(1, 3),
        verbose=0,
    ).fit()

    assert marker.exists(), "the worker was never killed"
    assert "worker_failed" in [e.kind for e in result.events]
    assert result.resets >= 1
    assert result.return_value["steps"] == steps
    # the kill came after step 12's update, before its commit at 15: rank 0 redoes steps 11 and 12
    reported = [m["step"] for m in result.metrics_history]
    assert reported.count(11) == 2 and reported.count(12) == 2, reported[:20]
    np.testing.assert_allclose(result.return_value["w"], linear_regression.TRUE_W, atol=0.05)


def mismatched_collectives(config: dict) -> None:
    """Rank 0 and rank 1 disagree on dtype, then shape; each is caught, then 4 vs 8 elements ends the run."""
    rank = elastic.rank()
    caught = []
    for dtype, shape in [(np.int32 if rank else np.float32, (4,)), (np.float32, (3, 2) if rank else (2, 3))]:
        try:
            elastic.allreduce(np.ones(shape, dtype))
        except CollectiveMismatchError as e:
            caught.append(str(e))
    # the ring is intact: no data moved in the mismatched calls
    total = elastic.allreduce(float(rank + 1), op="sum")
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"caught": caught, "total": total}, f)
    elastic.allreduce_(np.ones(8 if rank else 4, np.float32), "sum")  # unchecked, Gloo would abort the process


@pytest.mark.integration
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("gloo", marks=pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed in this venv")),
        pytest.param("pygloo", marks=pytest.mark.skipif(not HAS_PYGLOO, reason=NO_PYGLOO)),
    ],
)
def test_mismatched_collectives_fail_the_run_at_once_naming_each_rank(cluster, no_leaks, tmp_path, backend):
    out = tmp_path / "caught.json"
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as info:
        ElasticTrainer(mismatched_collectives, 2, 2, config={"out": str(out)}, backend=backend, verbose=0).fit()
    assert time.monotonic() - started < 30  # no crash loop, no collective_timeout waited out
    message = str(info.value)
    assert "CollectiveMismatchError: Mismatched allreduce tensor shapes: rank 0 (4,) float32, rank 1 (8,) float32" in (
        message
    )
    assert "mismatched_collectives" in message  # the user's traceback
    seen = json.loads(out.read_text())
    assert seen["total"] == 3.0
    assert [m.split(". ")[0] for m in seen["caught"]] == [
        "Mismatched allreduce data types: rank 0 (4,) float32, rank 1 (4,) int32",
        "Mismatched allreduce tensor shapes: rank 0 (2, 3) float32, rank 1 (3, 2) float32",
    ]
