"""Lightning on the cluster: one Trainer kept through a SIGKILL, a node added and a graceful leave.

One elastic run of a LightningModule on synthetic regression data, 4
workers: rank 1 is SIGKILLed mid-epoch, a node joins, then that node leaves
gracefully, and the test then asks the run to end at the next epoch's end.
Each step records every rank's sample ids (gathered over the ring) in the
module's checkpoint, so the record rolls back with the commit and covers
the ranks that left. A fault-free run of as many epochs (plain SGD in this
process, the same global batch) gives the loss to compare with.
"""

from __future__ import annotations

import json
import os
import signal
import time
from math import ceil
from pathlib import Path

import pytest
from conftest import wait_until
from runs import fit_in_thread

import ray_elastic as elastic

pytestmark = pytest.mark.integration

N, BATCH = 768, 16


def lightning_train_fn(config: dict) -> dict:
    import lightning.pytorch as pl
    import torch
    import torchmetrics
    from torch.utils.data import DataLoader, Dataset

    from ray_elastic.lightning import ElasticDDPStrategy, ElasticEnvironment, prepare_trainer

    out = Path(config["out"])
    (out / f"pid-{os.getpid()}").touch()

    class Indexed(Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(N, 8, generator=g)
            self.y = self.x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(N, 1, generator=g)

        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int):
            return i, self.x[i], self.y[i]

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.mse = torchmetrics.MeanSquaredError()
            self.seen: list = []  # (epoch, global step, world size, every rank's sample ids) per step

        def training_step(self, batch, batch_idx):
            ids, x, y = batch
            self.seen.append(
                (self.current_epoch, self.global_step, self.trainer.world_size, self.all_gather(ids).flatten().tolist())
            )
            fault = config.get("fault")
            if fault and self.global_step == fault["step"] and self.global_rank == fault["rank"]:
                if not os.path.exists(fault["marker"]):
                    Path(fault["marker"]).write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(config.get("step_s", 0))  # paces the run so that joins and leaves happen mid-epoch
            pred = self.net(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            self.mse(pred, y)
            self.log("train_loss", loss, sync_dist=True)
            self.log("train_mse", self.mse, on_step=False, on_epoch=True)
            if self.global_rank == 0:
                (out / "progress.tmp").write_text(json.dumps([self.global_step, self.trainer.world_size]))
                os.replace(out / "progress.tmp", out / "progress")
            return loss

        def on_train_epoch_end(self) -> None:
            # every rank ends the run at the same epoch's end once the test asks for it
            asked = (out / "stop").exists() or self.current_epoch + 1 >= config.get("epochs", 10**6)
            if self.trainer.strategy.reduce_boolean_decision(asked, all=False):
                self.trainer.should_stop = True

        def on_save_checkpoint(self, checkpoint):
            checkpoint["seen"] = list(self.seen)

        def on_load_checkpoint(self, checkpoint):
            self.seen = list(checkpoint["seen"])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = Indexed()
    model = Regression()
    trainer = pl.Trainer(
        max_epochs=1000,
        accelerator="cpu",
        strategy=ElasticDDPStrategy(commit_every=5),
        plugins=[ElasticEnvironment()],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    prepare_trainer(trainer).fit(model, train_dataloaders=DataLoader(data, batch_size=BATCH, shuffle=True))
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model.net(data.x), data.y))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = elastic.allgather_object(
        {
            "pid": os.getpid(),
            "params": params.tolist(),
            "seen": model.seen,
            "train_loss": float(trainer.callback_metrics["train_loss"]),
            "rank": elastic.rank(),
        }
    )
    return {
        "global_step": trainer.global_step,
        "epochs": trainer.current_epoch,
        "final_loss": final,
        "ranks": everyone,
        "train_mse": float(trainer.callback_metrics["train_mse"]),
    }


def implied_steps(seen: list) -> int:
    """The optimizer steps an epoch's world sizes imply, checked segment by segment against the sampler's split."""
    total = 0
    for epoch in sorted({s[0] for s in seen}):
        steps = [s for s in seen if s[0] == epoch]
        remaining = N
        segments: list[list] = []
        for s in steps:
            if not segments or segments[-1][0] != s[2]:
                segments.append([s[2], 0])
            segments[-1][1] += 1
        for i, (world, count) in enumerate(segments):
            if i == len(segments) - 1:  # the segment that ends the epoch takes every remaining sample
                assert count == ceil(ceil(remaining / world) / BATCH), (epoch, segments, remaining)
            remaining -= min(remaining, world * BATCH * count)
        total += len(steps)
    return total


def test_a_lightning_trainer_goes_on_through_a_sigkill_a_join_and_a_graceful_leave(cluster, no_leaks, tmp_path):
    host_a, host_b = (node.node_id for node in cluster.worker_nodes_at_start)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({host_a: 2, host_b: 2}))
    out = tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "killed"
    config = {"out": str(out), "step_s": 0.1, "fault": {"rank": 1, "step": 16, "marker": str(marker)}}
    fut = fit_in_thread(
        elastic.ElasticTrainer(
            lightning_train_fn,
            min_workers=2,
            max_workers=4,
            config=config,
            discovery=lambda: json.loads(hosts.read_text()),
            cooldown_range=(120, 120),
            verbose=0,
        )
    )
    progress = out / "progress"

    def world() -> int:
        try:
            return json.loads(progress.read_text())[1]
        except (FileNotFoundError, json.JSONDecodeError):
            return 0

    def until(predicate, what: str) -> None:
        wait_until(lambda: fut.done() or predicate(), 180, what)
        if fut.done():
            fut.result()
            raise AssertionError(f"fit() returned before {what}")

    node = None
    try:
        until(lambda: marker.exists() and world() == 3, "the SIGKILL and a world of 3")
        node = cluster.add_node(num_cpus=1)
        hosts.write_text(json.dumps({host_a: 2, host_b: 2, node.node_id: 1}))
        until(lambda: world() == 4, "the added node's worker to join")
        hosts.write_text(json.dumps({host_a: 2, host_b: 2}))  # the node leaves gracefully
        until(lambda: world() == 3, "the added node's worker to leave")
        (out / "stop").touch()
        result = fut.result(timeout=240)
    finally:
        (out / "stop").touch()
        if not fut.done():
            fut.exception(timeout=240)
        if node is not None:
            cluster.remove_node(node)
    kinds = [e.kind for e in result.events]
    assert "worker_failed" in kinds and "hosts_added" in kinds and "hosts_removed" in kinds, kinds
    value = result.return_value
    ranks = value["ranks"]
    assert all(r["params"] == ranks[0]["params"] for r in ranks), "ranks bitwise equal at the end"
    assert len({r["train_loss"] for r in ranks}) == 1, "a sync_dist value is the same on every rank"
    started = {int(p.name.split("-")[1]) for p in out.glob("pid-*")}
    assert len(started) == 5, "4 starters and one newcomer: the survivors kept their processes"
    assert {r["pid"] for r in ranks} <= started
    seen = next(r for r in ranks if r["rank"] == 0)["seen"]
    epochs = value["epochs"]
    for epoch in range(epochs):
        ids = [i for s in seen if s[0] == epoch for i in s[3]]
        assert set(ids) == set(range(N)), f"epoch {epoch} missed {sorted(set(range(N)) - set(ids))[:10]}"
        assert len(ids) - N <= 3 * 4, (epoch, len(ids))  # repeats only to pad an uneven split, once per world
    assert [s[1] for s in seen] == list(range(len(seen))), "no optimizer step lost or counted twice"
    assert value["global_step"] == implied_steps(seen)
    assert value["train_mse"] > 0  # the torchmetrics metric synced through the resizes
    assert value["final_loss"] == pytest.approx(reference_loss(epochs), rel=0.05)


def reference_loss(epochs: int) -> float:
    """A fault-free run's final loss, in this process: plain SGD on the same data, `epochs` epochs.

    4 DDP ranks of 16 samples whose gradients are averaged take the same
    step as one process taking all 64, at the LR `ElasticDDPStrategy` scales
    by the world size (`scale_lr`: 0.01 x 4; at 3 ranks an epoch has 4/3 the
    steps at 3/4 the LR); only the initial weights and the sample order
    differ, as they do between two elastic runs. No Ray and no Lightning: a
    second cluster run cost more than the faulty one's checks.
    """
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = x @ torch.arange(1.0, 9.0).unsqueeze(1) + 0.1 * torch.randn(N, 1, generator=g)
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01 * 4)
    for _ in range(epochs):
        for idx in torch.randperm(N).split(4 * BATCH):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(net(x), y))
