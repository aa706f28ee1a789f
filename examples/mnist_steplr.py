"""The classic PyTorch MNIST recipe, elastic: a small CNN, Adadelta, StepLR, a test pass per epoch.

The data is synthetic and MNIST-shaped, made in the script (nothing is
downloaded): 28x28 images of Gaussian noise, each labelled by a fixed random
linear teacher (one weight per 7x7 block of pixels and class), so there is
something to learn and the test accuracy rises from chance (10%).

The elastic parts, all on the gradient-averaging `DistributedOptimizer`
path (it is a `torch.optim.Optimizer`, so `StepLR` drives it as it drives
Adadelta):

- `prepare_data_loader` shards a plain shuffling `DataLoader` over the
  workers; each batch counts as trained when the loop comes back for the
  next one (no bookkeeping call), exactly once per epoch through resets;
- `TorchState(model=, optimizer=, scheduler=, loader=, epoch=)` commits and
  rolls back all of them together: the scheduler the loop holds is the one
  that rolls back, so a failure never steps it twice;
- `@elastic.run` re-enters `train` after every reset, and `train` scales the
  learning rate by the world size on entry, from the first generation on.
  It rescales by new size / old size (`state.lr_world` is the size the
  current LR is scaled for) instead of setting the LR, so the decay StepLR
  applied so far is kept.

The test pass splits the test set over the ranks and sums the loss and the
hits with one allreduce; rank 0 prints the classic lines.

    python examples/mnist_steplr.py --epochs 2        # on a local Ray it starts
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ray_elastic as elastic

DEFAULTS = {
    "epochs": 5,
    "lr": 1.0,  # Adadelta's, per worker: train() multiplies it by the world size
    "gamma": 0.7,
    "batch_size": 64,  # per worker
    "train_size": 8192,
    "test_size": 1024,
    "commit_every": 10,
    "log_interval": 20,
    "seed": 1,
}


class Net(nn.Module):
    """Two convolutions, max-pooling and dropout, two linear layers: the classic MNIST network, slimmed."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 12 * 12, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(train_size: int, test_size: int, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Noise images labelled by a random linear teacher over 7x7 blocks of pixels; the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    teacher = F.interpolate(torch.randn(10, 1, 4, 4, generator=gen), scale_factor=7).flatten(1).T  # (784, 10)

    def make(n: int) -> TensorDataset:
        images = torch.randn(n, 1, 28, 28, generator=gen)
        return TensorDataset(images, (images.flatten(1) @ teacher).argmax(dim=1))

    return make(train_size), make(test_size)


def evaluate(model: nn.Module, test_set: TensorDataset) -> tuple[float, int]:
    """Average loss and hits over the whole test set: each rank takes every size-th image, one allreduce sums."""
    images, labels = test_set.tensors
    mine = slice(elastic.rank(), None, elastic.size())
    model.eval()
    with torch.no_grad():
        output = model(images[mine])
        loss = F.nll_loss(output, labels[mine], reduction="sum")
        hits = (output.argmax(dim=1) == labels[mine]).sum()
    model.train()
    total = elastic.allreduce(torch.stack([loss.double(), hits.double()]), op=elastic.Sum)
    return total[0].item() / len(labels), int(total[1].item())


def digest(model: nn.Module) -> str:
    """sha256 of the parameters, bit for bit."""
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def train_fn(config: dict) -> dict:
    cfg = {**DEFAULTS, **config}
    step_hook: Callable[[int], None] | None = cfg.get("step_hook")  # tests inject faults through it
    torch.manual_seed(cfg["seed"])
    train_set, test_set = synthetic_mnist(cfg["train_size"], cfg["test_size"], cfg["seed"])
    model = Net()
    optimizer = elastic.torch.DistributedOptimizer(
        torch.optim.Adadelta(model.parameters(), lr=cfg["lr"]), named_parameters=model.named_parameters()
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=cfg["gamma"])
    loader = elastic.torch.prepare_data_loader(
        DataLoader(train_set, batch_size=cfg["batch_size"], shuffle=True), seed=cfg["seed"]
    )
    state = elastic.torch.TorchState(
        model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, epoch=0, step=0, lr_world=1, history=[]
    )

    @elastic.run
    def train(state: elastic.torch.TorchState) -> dict:
        factor = elastic.size() / state.lr_world
        for group in optimizer.param_groups:
            group["lr"] *= factor
        scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]  # for schedulers that start from them
        state.lr_world = elastic.size()
        while state.epoch < cfg["epochs"]:
            loader.set_epoch(state.epoch)
            for x, y in loader:
                optimizer.zero_grad()
                loss = F.nll_loss(model(x), y)
                loss.backward()
                optimizer.step()
                state.step += 1
                elastic.report({"epoch": state.epoch + 1, "step": state.step, "loss": loss.item()})
                if elastic.rank() == 0 and state.step % cfg["log_interval"] == 0:
                    done = loader.sampler.num_processed
                    print(f"Train Epoch: {state.epoch + 1} [{done}/{len(train_set)}]\tLoss: {loss.item():.6f}")
                if step_hook is not None:
                    step_hook(state.step)
                if state.step % cfg["commit_every"] == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            test_loss, hits = evaluate(model, test_set)
            accuracy = hits / len(test_set)
            if elastic.rank() == 0:
                print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {hits}/{len(test_set)} ({accuracy:.0%})\n")
            scheduler.step()  # once per epoch; the epoch's end commits it with the counter
            state.history.append({"epoch": state.epoch + 1, "test_loss": test_loss, "accuracy": accuracy})
            state.epoch += 1
            state.commit()
            elastic.report(state.history[-1] | {"step": state.step, "lr": optimizer.param_groups[0]["lr"]})
        return {
            "history": state.history,
            "lr": optimizer.param_groups[0]["lr"],
            "world_size": elastic.size(),
            "steps": state.step,
            "digests": elastic.allgather_object(digest(model)),
        }

    return train(state)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"], help="per worker; scaled by the world size")
    parser.add_argument("--gamma", type=float, default=DEFAULTS["gamma"], help="StepLR's decay per epoch")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="per worker")
    parser.add_argument("--min-workers", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = {"epochs": args.epochs, "lr": args.lr, "gamma": args.gamma, "batch_size": args.batch_size}
    result = elastic.ElasticTrainer(
        train_fn, min_workers=args.min_workers, max_workers=args.max_workers, config=config | {"seed": args.seed}
    ).fit()
    value = result.return_value
    last = value["history"][-1]
    print(
        f"test accuracy {last['accuracy']:.3f} after {last['epoch']} epochs ({value['steps']} steps) "
        f"on {value['world_size']} workers; learning rate {value['lr']:.4g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
