"""`examples/mnist_steplr.py` end to end on the local cluster: a SIGKILL mid-epoch, and the script's own main().

What a user of the example would notice: the learning rate after N epochs is
StepLR's 0.7**N times the base scaled by the final world size (a scheduler
stepped twice by a replayed epoch end, or a rescale that threw the decay
away, would show), one test pass per epoch in the history, an accuracy well
above chance that rises, and every rank ending with the same parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from workloads import FaultHook

from ray_elastic import ElasticTrainer

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
from mnist_steplr import DEFAULTS, main, train_fn  # noqa: E402

pytestmark = pytest.mark.integration

EPOCHS = 2
CHANCE = 0.1


def test_mnist_steplr_survives_a_sigkill_with_the_lr_schedule_and_accuracy_intact(cluster, no_leaks, tmp_path):
    # 4 workers take 32 steps an epoch: rank 1 dies in the second epoch, between two commits
    kill = {"rank": 1, "step": 45, "action": "sigkill", "marker": str(tmp_path / "killed")}
    config = {"epochs": EPOCHS, "step_hook": FaultHook([kill])}
    result = ElasticTrainer(train_fn, 2, 4, config=config, cooldown_range=(1, 5), verbose=0).fit()
    value = result.return_value

    assert (tmp_path / "killed").exists(), "the fault never fired"
    assert [e.kind for e in result.events].count("worker_failed") == 1
    epochs = [h["epoch"] for h in value["history"]]
    assert epochs == list(range(1, EPOCHS + 1)), f"an epoch's test pass was lost or doubled: {epochs}"
    expected_lr = DEFAULTS["lr"] * value["world_size"] * DEFAULTS["gamma"] ** EPOCHS
    assert value["lr"] == pytest.approx(expected_lr, rel=1e-9), f"LR {value['lr']}, StepLR's says {expected_lr}"
    accuracy = [h["accuracy"] for h in value["history"]]
    assert accuracy[-1] > 2 * CHANCE and accuracy[-1] > accuracy[0], f"test accuracy per epoch: {accuracy}"
    assert len(set(value["digests"])) == 1, "ranks ended with different parameters"


def test_the_script_main_trains_and_prints_its_summary(cluster, no_leaks, capsys):
    assert main(["--epochs", "1", "--max-workers", "2"]) == 0
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("test accuracy ") and "after 1 epochs" in summary and "on 2 workers" in summary
    assert f"learning rate {DEFAULTS['lr'] * 2 * DEFAULTS['gamma']:.4g}" in summary
