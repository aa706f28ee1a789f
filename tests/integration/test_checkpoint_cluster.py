"""Resuming from durable checkpoints on real clusters.

- An unwritable `checkpoint_dir` fails `fit()` before anything is spawned.
- Every worker lost at once (Horovod #3197): with `checkpoint_dir` the run
  resumes from it with fresh workers and finishes with exact sample accounting
  (without one, the error says how to resume: test_integration.py's
  all-workers-failing test).
- The whole cluster lost: a new `fit()` on another cluster resumes from the
  checkpoint and finishes with exact sample accounting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from soak import check_ledger, digits, soak_train_fn
from workloads import counting_train_fn

import ray_elastic as elastic
from ray_elastic import ElasticTrainer
from ray_elastic.checkpoint import CheckpointStore

SUPPORT = Path(__file__).parents[1] / "support"


@pytest.mark.integration
def test_unwritable_checkpoint_dir_fails_fit_before_spawning(cluster, no_leaks, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is not writable"):
        ElasticTrainer(counting_train_fn, 1, 1, checkpoint_dir=str(blocker / "sub"), verbose=0).fit()


@pytest.mark.integration
def test_every_worker_lost_resumes_from_the_durable_checkpoint(cluster, no_leaks, tmp_path):
    """Horovod #3197: no host of the previous set remains. Fresh workers resume from the checkpoint."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    epochs = 2  # 23 steps an epoch: the kill at step 33 comes in the last epoch
    faults = [{"rank": r, "step": 33, "action": "sigkill", "marker": str(tmp_path / f"fault{r}")} for r in range(2)]
    config = {"seed": 0, "lr": 0.05, "epochs": epochs, "ledger_dir": str(ledger), "faults": faults}
    started = time.monotonic()
    result = ElasticTrainer(
        soak_train_fn,
        2,
        2,
        config=config,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=2,
        cooldown_range=(0.5, 1),
        verbose=0,
    ).fit()
    assert time.monotonic() - started < 120
    kinds = [e.kind for e in result.events]
    assert "restarted" in kinds and "resumed" in kinds, result.events
    resumed = next(e for e in result.events if e.kind == "resumed")
    assert "commit" in resumed.detail
    value = result.return_value
    assert value["epochs"] == epochs
    assert len(set(value["digests"])) == 1
    restarted_event = next(e for e in result.events if e.kind == "restarted")
    print(f"every worker lost -> resumed from the checkpoint in {restarted_event.reset_duration:.1f} s")
    restarted = restarted_event.generation
    lines = [json.loads(line) for f in ledger.glob("*.jsonl") for line in f.read_text().splitlines()]
    resumed_at = {e["step"] for e in lines if e.get("sync") == restarted}
    # a checkpoint every 2nd commit (every 5 steps and at each epoch's end): the last before the kill is past step 20
    assert len(resumed_at) == 1 and 20 <= min(resumed_at) < 33, f"fresh workers resumed at steps {resumed_at}"
    figures = check_ledger(str(ledger), value["n"], epochs, max_world=2)
    assert figures["samples_checked"] >= epochs * value["n"]
    # the last durable checkpoint, as users open it: a ray.train.Checkpoint of plain files, the newest 2 kept
    from ray.train import Checkpoint

    assert isinstance(result.checkpoint, Checkpoint)
    assert [os.path.basename(p) for p in CheckpointStore(str(tmp_path / "ckpt")).checkpoints()] == sorted(
        os.listdir(tmp_path / "ckpt")
    )
    assert len(os.listdir(tmp_path / "ckpt")) == 2, "checkpoint_keep=2 by default"
    opened = elastic.load_checkpoint(result.checkpoint)
    fresh = digits.make_model()
    fresh.load_state_dict(torch.load(os.path.join(result.checkpoint.path, "model.pt")))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in opened["model"].items())


@pytest.mark.integration
def test_whole_cluster_lost_then_a_new_fit_resumes(cluster, no_leaks, tmp_path):
    """The cluster dies mid-run (every process, head included); a new fit() on another cluster finishes the job.

    The first run has a cluster of its own, in a process of its own, both killed at once. The session's
    cluster and this test's process never saw that run: to the resuming fit() they are a new cluster and a
    new driver, with nothing but the checkpoint directory in common with the lost ones.
    """
    ckpt, ledger = tmp_path / "ckpt", tmp_path / "ledger"
    ledger.mkdir()
    script = [sys.executable, str(SUPPORT / "resume_run.py"), "--checkpoint-dir", str(ckpt)]
    script += ["--ledger-dir", str(ledger)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    lost = subprocess.run(
        [*script, "--attempt", "0", "--lose-cluster-after-commit", "10"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert lost.returncode == 3, f"the first run did not lose its cluster as planned:\n{lost.stderr[-3000:]}"
    meta = CheckpointStore(str(ckpt)).meta()
    assert meta["commit"] >= 10
    # as resume_run.py --attempt 1 runs it, on the session's cluster
    result = ElasticTrainer(
        soak_train_fn,
        2,
        2,
        config={"seed": 0, "lr": 0.05, "epochs": 4, "ledger_dir": str(ledger), "attempt": 1},
        checkpoint_dir=str(ckpt),
        checkpoint_every=2,
        verbose=0,
    ).fit()
    value = result.return_value
    assert value["epochs"] == 4
    assert len(set(value["digests"])) == 1
    assert result.metrics_history[0]["step"] > 1, "the new fit() resumed from the checkpoint instead of starting over"
    assert any(e.kind == "resumed" for e in result.events), result.events
    figures = check_ledger(str(ledger), value["n"], 4, max_world=2)
    assert figures["rolled_back_lines"] > 0, "steps after the last checkpoint were lost with the cluster"
