"""The small MLP the recovery, scale, step-cost and memory benchmarks train, and Ray Train's side of it.

One definition, so every benchmark and every peer trains the same model on
the same kind of batch, and Ray Train's checkpoint save and resume are
written once.
"""

from __future__ import annotations

import os
import tempfile

import torch


def make_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def random_batch(generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, generator: torch.Generator | None = None) -> None:
    x, y = random_batch(generator)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def raytrain_resume(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Inside a Ray Train worker: load the last checkpoint into `model` (DDP-wrapped) and `opt`; the step."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as d:
        saved = torch.load(os.path.join(d, "state.pt"))
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    return saved["step"]


def raytrain_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    """Inside a Ray Train worker: report a checkpoint of `step` (rank 0 writes the state)."""
    import ray.train

    with tempfile.TemporaryDirectory() as d:
        if rank == 0:
            torch.save(
                {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                os.path.join(d, "state.pt"),
            )
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))
