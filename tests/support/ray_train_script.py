"""A Ray Train v2 script in its documented shape (the Fashion-MNIST guide's), on synthetic data.

Only the imports differ from Ray Train's: `TorchTrainer`, `prepare_model` and
`prepare_data_loader` come from `ray_elastic.train.torch`, while the loop
calls `ray.train.report`, `ray.train.get_checkpoint` and
`ray.train.get_context` fully qualified, as the guide does. It evaluates on a
prepared test loader every epoch (dividing by its `len`), passes a checkpoint
to every few reports and resumes from `get_checkpoint()`. With
`fully_qualified`, it prepares through `ray.train.torch.prepare_model` and
`prepare_data_loader` too.

For the tests it also logs, per worker, every step's sample ids and every
entry into the loop (`log`), and can SIGKILL itself once (`kill`).
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

import ray.train
import ray.train.torch
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ray_elastic.train import Checkpoint, RunConfig, ScalingConfig
from ray_elastic.train.torch import TorchTrainer, prepare_data_loader, prepare_model

NUM_TRAIN, NUM_TEST = 96, 32


def fashion_like(n: int, seed: int) -> TensorDataset:
    """28x28 'images' of 10 classes: a class's pixels are its template plus noise; the last column is the id."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 28 * 28, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (n,), generator=g)
    images = templates[labels] + 0.5 * torch.randn(n, 28 * 28, generator=g)
    return TensorDataset(images.view(n, 1, 28, 28), labels, torch.arange(n))


class NeuralNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _log(config: dict, **record) -> None:
    with open(config["log"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "time": time.time(), **record}) + "\n")


def train_func_per_worker(config: dict) -> None:
    train_loader = DataLoader(fashion_like(NUM_TRAIN, 1), batch_size=config["batch_size_per_worker"], shuffle=True)
    test_loader = DataLoader(fashion_like(NUM_TEST, 2), batch_size=config["batch_size_per_worker"])
    if config.get("fully_qualified"):  # the script as Ray Train's guide writes it, but for TorchTrainer's import
        train_loader = ray.train.torch.prepare_data_loader(train_loader)
        test_loader = ray.train.torch.prepare_data_loader(test_loader)
        model = ray.train.torch.prepare_model(NeuralNetwork())
    else:
        train_loader = prepare_data_loader(train_loader)
        test_loader = prepare_data_loader(test_loader)
        model = prepare_model(NeuralNetwork())
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)

    start_epoch, step = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "checkpoint.pt"))
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch, step = saved["epoch"], saved["step"]
    context = ray.train.get_context()
    _log(
        config,
        entry=True,
        rank=context.get_world_rank(),
        size=context.get_world_size(),
        at=[start_epoch, step],
        experiment=context.get_experiment_name(),
    )

    for epoch in range(start_epoch, config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        model.train()
        for X, y, ids in train_loader:
            _maybe_kill(config, epoch, step, "step")
            loss = loss_fn(model(X), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            _log(
                config,
                epoch=epoch,
                step=step,
                ids=ids.tolist(),
                rank=ray.train.get_context().get_world_rank(),
                size=ray.train.get_context().get_world_size(),
            )
            time.sleep(config.get("step_sleep", 0.0))
            if step % config["checkpoint_every"] == 0:
                _maybe_kill(config, epoch, step, "report")  # the others are in report() when this rank dies
                try:  # a script that swallows its own errors must not swallow the run's interrupts
                    _report(model, optimizer, epoch, step, {"loss": loss.item(), "epoch": epoch})
                except Exception as e:  # noqa: BLE001 - what some users write
                    _log(config, swallowed=repr(e))

        model.eval()
        test_loss, num_correct, num_total = 0.0, 0, 0
        with torch.no_grad():
            for X, y, _ in test_loader:
                pred = model(X)
                test_loss += loss_fn(pred, y).item()
                num_correct += (pred.argmax(1) == y).sum().item()
                num_total += len(y)
        metrics = {"loss": test_loss / len(test_loader), "accuracy": num_correct / num_total, "epoch": epoch}
        _log(
            config,
            test=epoch,
            num_total=num_total,
            rank=ray.train.get_context().get_world_rank(),
            digest=float(sum(p.detach().double().sum() for p in model.parameters())),
        )
        _report(model, optimizer, epoch + 1, step, metrics)


def _maybe_kill(config: dict, epoch: int, step: int, where: str) -> None:
    """SIGKILL this worker once, at `kill["at"]` (epoch, steps done) and `kill["where"]`, if it is `kill["rank"]`."""
    kill = config.get("kill")
    if not kill or [epoch, step] != kill["at"] or kill.get("where", "step") != where:
        return
    if ray.train.get_context().get_world_rank() != kill["rank"]:
        return
    try:
        os.close(os.open(kill["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # once, across the workers
    except FileExistsError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def _report(model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int, metrics: dict) -> None:
    """Ray Train v2's pattern: rank 0 writes the checkpoint to a temporary directory, every rank reports."""
    with tempfile.TemporaryDirectory() as d:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            state = {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "epoch": epoch,
                "step": step,
            }
            torch.save(state, os.path.join(d, "checkpoint.pt"))
            checkpoint = Checkpoint.from_directory(d)
        ray.train.report(metrics, checkpoint=checkpoint)


def train_fashion_mnist(config: dict, num_workers, storage_path: str, name: str = "fashion"):
    trainer = TorchTrainer(  # only this import (and the configs') differs from a Ray Train script
        train_func_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(name=name, storage_path=storage_path),
    )
    return trainer.fit()


def train_func_on_a_dataset(config: dict) -> None:
    """Ray Train's Ray Data shape: each epoch one `iter_torch_batches` pass over this worker's shard.

    A report with a checkpoint ends each epoch; a loop entered again resumes after the checkpoint's epoch.
    Every entry is logged with the epoch it starts at and an id its batch records carry (`attempt`).
    """
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d, open(os.path.join(d, "epoch.json")) as f:
            start = json.load(f)["epoch"] + 1
    rank = ray.train.get_context().get_world_rank()
    attempt = f"{os.getpid()}-{time.monotonic_ns()}"
    _log(config, entry=True, start_epoch=start, attempt=attempt, rank=rank)
    shard = ray.train.get_dataset_shard("train")
    for epoch in range(start, config["epochs"]):
        for step, batch in enumerate(shard.iter_torch_batches(batch_size=config["batch_size"]), start=1):
            _log(config, epoch=epoch, ids=batch["id"].tolist(), rank=rank, attempt=attempt)
            _maybe_kill(config, epoch, step, "step")
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "epoch.json"), "w") as f:
                json.dump({"epoch": epoch}, f)
            ray.train.report({"epoch": epoch}, checkpoint=Checkpoint.from_directory(d))
