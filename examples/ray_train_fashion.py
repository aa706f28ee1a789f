"""Ray Train's Fashion-MNIST guide, elastic in place: only the imports differ from the Ray Train script.

The guide's loop (prepared train and test loaders, `prepare_model`, a test
pass every epoch, `ray.train.report` with a checkpoint, resuming from
`ray.train.get_checkpoint()`), on synthetic 28x28 images of 10 classes (no
download). Kill a worker while it trains (`kill -9` on one of the
`WorkerActor` processes): the others re-enter the loop in their own
processes from the last reported checkpoint and go on, and a worker started
later on a new node joins at the next report.

    python examples/ray_train_fashion.py --workers 2 4 --epochs 10
"""

from __future__ import annotations

import argparse
import os
import tempfile

import ray.train
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ray_elastic.train import Checkpoint, RunConfig, ScalingConfig  # was: from ray.train import ...
from ray_elastic.train.torch import TorchTrainer, prepare_data_loader, prepare_model  # was: from ray.train.torch


def fashion_like(n: int, seed: int) -> TensorDataset:
    """Fashion-MNIST's shapes without the download: each class a fixed 28x28 pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 28 * 28, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (n,), generator=g)
    return TensorDataset((patterns[labels] + torch.randn(n, 28 * 28, generator=g)).view(n, 1, 28, 28), labels)


def get_dataloaders(batch_size: int) -> tuple[DataLoader, DataLoader]:
    train_set, test_set = fashion_like(6000, 1), fashion_like(1000, 2)
    return DataLoader(train_set, batch_size=batch_size, shuffle=True), DataLoader(test_set, batch_size=batch_size)


class NeuralNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(28 * 28, 512),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(512, 512),
            nn.ReLU(),
            nn.Dropout(0.25),
            nn.Linear(512, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def train_func_per_worker(config: dict) -> None:
    train_loader, test_loader = get_dataloaders(config["batch_size_per_worker"])
    train_loader = prepare_data_loader(train_loader)
    test_loader = prepare_data_loader(test_loader)
    model = prepare_model(NeuralNetwork())
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)

    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "checkpoint.pt"))
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch = saved["epoch"]

    for epoch in range(start_epoch, config["epochs"]):
        if ray.train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)
        model.train()
        for X, y in train_loader:
            loss = loss_fn(model(X), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        model.eval()
        test_loss, num_correct, num_total = 0.0, 0, 0
        with torch.no_grad():
            for X, y in test_loader:
                pred = model(X)
                test_loss += loss_fn(pred, y).item()
                num_correct += (pred.argmax(1) == y).sum().item()
                num_total += len(y)
        metrics = {"loss": test_loss / len(test_loader), "accuracy": num_correct / num_total, "epoch": epoch}
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if ray.train.get_context().get_world_rank() == 0:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
                torch.save(state, os.path.join(d, "checkpoint.pt"))
                checkpoint = Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--storage-path", default=os.path.expanduser("~/ray_results"))
    args = parser.parse_args()
    trainer = TorchTrainer(
        train_func_per_worker,
        train_loop_config={"lr": 1e-3, "epochs": args.epochs, "batch_size_per_worker": 16},
        scaling_config=ScalingConfig(num_workers=tuple(args.workers)),
        run_config=RunConfig(storage_path=args.storage_path),
    )
    result = trainer.fit()
    print(f"Training result: {result.metrics}, checkpoint at {result.checkpoint.path}")


if __name__ == "__main__":
    main()
