"""The training of tests/integration/test_netns.py's healed-partition test: `DistributedOptimizer`, logged step by step.

Every step's data comes from (step, rank, world size) alone, so the test can
replay the survivors' steps from the state their generation started with
(`batch`, `model`, `replay`). Every worker appends one line per completed
step to `{log_dir}/{worker_id}.jsonl` (its generation, world size and wall
time), which shows whether a cut-off worker completed a step after the
heal. Rank 0 saves the synced state at each generation's start, and the
final parameters. The run stops at the first step after `stop_file` appears.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

import ray_elastic as elastic
from ray_elastic.collective import torch_dist
from ray_elastic.runtime import current

DIM = 256
LR = 0.01


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.Tanh(), torch.nn.Linear(2 * DIM, DIM))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1009 + rank * 31 + size)
    return torch.randn(32, DIM, generator=gen), torch.randn(32, DIM, generator=gen)


def loss_of(net: torch.nn.Module, step: int, rank: int, size: int) -> torch.Tensor:
    x, y = batch(step, rank, size)
    return (net(x) - y).pow(2).mean()


def replay(start: dict, steps: list[int], size: int) -> dict[str, torch.Tensor]:
    """The parameters after `steps` (in order) from `start`'s, averaging `size` ranks' gradients, as SGD does."""
    net = model()
    net.load_state_dict(start)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step in steps:
        grads = []
        for rank in range(size):
            net.zero_grad()
            loss_of(net, step, rank, size).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, *per_rank in zip(net.parameters(), *grads, strict=True):
            p.grad = sum(g / size for g in per_rank)
        opt.step()
    return net.state_dict()


def fenced_train_fn(config: dict) -> dict:
    torch.set_num_threads(1)
    log_dir = Path(config["log_dir"])
    worker = current().worker_id
    net = model()
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR), net.named_parameters())
    state = elastic.torch.TorchState(model=net, optimizer=opt, step=0)
    started = time.monotonic()

    @elastic.run
    def train(state) -> dict:
        generation, rank, size = current().generation, elastic.rank(), elastic.size()
        if rank == 0:
            torch.save({"step": state.step, "model": net.state_dict()}, log_dir / f"start-g{generation}.pt")
        with open(log_dir / f"{worker}.jsonl", "a") as log:
            while True:
                stop = rank == 0 and Path(config["stop_file"]).exists()
                if elastic.broadcast_object(stop):
                    break
                if time.monotonic() - started > config["deadline_s"]:
                    raise TimeoutError(f"the test did not stop the run within {config['deadline_s']} s")
                opt.zero_grad()
                loss_of(net, state.step, rank, size).backward()
                opt.step()
                state.step += 1
                state.commit()
                line = {"step": state.step, "generation": generation, "world": size, "rank": rank, "t": time.time()}
                log.write(json.dumps(line) + "\n")
                log.flush()
                elastic.report({"step": state.step, "world_size": size, "rank0": worker})
                if rank == 0 and state.step >= config["signal_step"] and size == config["signal_world_size"]:
                    Path(config["signal_file"]).touch()
                time.sleep(config.get("step_time", 0.02))  # stands for the compute of a real step
        if rank == 0:
            torch.save(net.state_dict(), log_dir / "final.pt")
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
        return {
            "steps": state.step,
            "world_size": size,
            "rank0": worker,
            "digests": elastic.allgather_object(digest),
            "late_completions": elastic.allgather_object(torch_dist.late_completions()),
        }

    return train(state)
