"""A PyTorch Lightning classifier on MNIST-shaped data, elastic: `ElasticDDPStrategy` and `prepare_trainer`.

The data are synthetic 28x28 images (nothing downloaded): each of the 10
classes is a fixed random pattern plus noise, so a small convolutional net
learns them in a few epochs. The training function is the Lightning script
a user already has, with the elastic strategy and environment in the
Trainer and one line more: `prepare_trainer(trainer)`. Under
`ElasticTrainer.fit()` the Trainer keeps training through lost and added
workers, in the same processes, rolling back to its last in-memory commit.

    python examples/lightning_mnist.py                 # on a local Ray it starts
    python examples/lightning_mnist.py --epochs 5 --workers 4
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ray_elastic as elastic
from ray_elastic.lightning import ElasticDDPStrategy, ElasticEnvironment, prepare_trainer


def mnist_shaped(n: int, seed: int = 0) -> TensorDataset:
    """`n` 1x28x28 images of 10 classes: a class's fixed pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 28, 28, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = patterns[labels] + 0.8 * torch.randn(n, 1, 28, 28, generator=g)
    return TensorDataset(images, labels)


class Classifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 6 * 6, 10),
        )

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        accuracy = (self.net(images).argmax(1) == labels).float().mean()
        self.log("val_accuracy", accuracy, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


def train_fn(config: dict) -> dict:
    torch.manual_seed(0)
    model = Classifier(lr=config["lr"])
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        accelerator="cpu",
        strategy=ElasticDDPStrategy(commit_every=10),  # an in-memory commit every 10 optimizer steps
        plugins=[ElasticEnvironment()],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = prepare_trainer(trainer)
    train = DataLoader(mnist_shaped(config["samples"]), batch_size=32, shuffle=True)
    val = DataLoader(mnist_shaped(1024, seed=1), batch_size=256)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    elastic.report({"global_step": trainer.global_step, **metrics})
    return {"global_step": trainer.global_step, **metrics}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=0.02, help="per worker: scaled by the world size")
    parser.add_argument("--workers", type=int, default=2, help="max_workers (min_workers is 1)")
    opts = parser.parse_args()
    result = elastic.ElasticTrainer(
        train_fn,
        min_workers=1,
        max_workers=opts.workers,
        config={"epochs": opts.epochs, "samples": opts.samples, "lr": opts.lr},
    ).fit()
    value = result.return_value
    print(f"trained {value['global_step']} steps: val_accuracy {value['val_accuracy']:.3f}")
    print(f"membership events: {[e.kind for e in result.events]}")


if __name__ == "__main__":
    main()
