"""Elastic PyTorch training on real data: scikit-learn's bundled digits.

1797 handwritten 8x8 digits ship inside scikit-learn (nothing is
downloaded). A small MLP trains with `TorchState` (model, optimizer,
sampler, counters), an exact `ElasticSampler` and `DistributedOptimizer`;
the learning rate follows the world size through a reset callback.

After every (re)entry into the training function, i.e. right after each
sync, the ranks compare digests of their parameters and optimizer state, so
a run can prove that all ranks held bitwise-equal state after every reset.

    python examples/digits.py        # on a local Ray it starts
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import ray_elastic as elastic

DEFAULTS = {"epochs": 15, "lr": 0.02, "batch_size": 16, "commit_every": 5, "seed": 0}


def load_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits, scaled to [0, 1], split 80/20 with a fixed permutation."""
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 of the parameters and the optimizer's tensors, bit for bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    for p in model.parameters():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            h.update(key.encode())
            h.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())


def train_fn(config: dict) -> dict:
    cfg = {**DEFAULTS, **config}
    step_hook: Callable[[int], None] | None = cfg.get("step_hook")
    torch.manual_seed(cfg["seed"])
    x_train, y_train, x_test, y_test = load_data(cfg["seed"])
    dataset = TensorDataset(x_train, y_train)
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    optimizer = elastic.torch.DistributedOptimizer(base, named_parameters=model.named_parameters())
    sampler = elastic.torch.ElasticSampler(dataset, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(dataset, batch_size=cfg["batch_size"], sampler=sampler)
    state = elastic.torch.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)

    def scale_lr() -> None:
        for group in optimizer.param_groups:
            group["lr"] = cfg["lr"] * elastic.size()

    state.register_reset_callbacks([scale_lr])
    sync_checks: list[dict] = []

    @elastic.run
    def train(state: elastic.torch.TorchState) -> dict:
        scale_lr()
        digests = elastic.allgather_object(state_digest(model, base))
        sync_checks.append({"step": state.step, "world_size": elastic.size(), "equal": len(set(digests)) == 1})
        while state.epoch < cfg["epochs"]:
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                sampler.record_batch(i, cfg["batch_size"])
                state.step += 1
                elastic.report(
                    {"epoch": state.epoch, "step": state.step, "loss": loss.item(), "world_size": elastic.size()}
                )
                if step_hook is not None:
                    step_hook(state.step)
                if state.step % cfg["commit_every"] == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            # epoch counter and sampler move together, then commit: a rollback keeps them in step
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
        final = elastic.allgather_object(state_digest(model, base))
        return {
            "accuracy": accuracy(model, x_test, y_test),
            "steps": state.step,
            "world_size": elastic.size(),
            "final_digests": final,
            "sync_checks": sync_checks,
            "padding_trained": sampler.padding_trained,
        }

    return train(state)


def main() -> None:
    result = elastic.ElasticTrainer(train_fn, min_workers=2, max_workers=4, config={"epochs": 15}).fit()
    print(f"test accuracy: {result.return_value['accuracy']:.3f} after {result.return_value['steps']} steps")


if __name__ == "__main__":
    main()
