"""A Ray Train FSDP2 loop in the shape of Ray's FSDP2 guide, on synthetic data, on the CPU with Gloo.

The shape: the mesh from `init_device_mesh(device, (world_size,))`,
`fully_shard` on each block and on the root, AdamW, an `AppState`
(`Stateful`) holding the model's and the optimizer's sharded state dicts,
`dcp.save` into a temporary directory on every rank and
`ray.train.report(metrics, checkpoint=Checkpoint.from_directory(dir))`; at
the start `ray.train.get_checkpoint()` and `dcp.load` into the freshly
sharded model; at the end the full model, saved by rank 0 and reported with
`checkpoint_dir_name="full_model"`. Only the imports (`ray_elastic.train`)
make it elastic.

For the tests it logs (`config["log"]`, one JSON line per record) every
entry into the loop (with its node, and a checksum of the full state it
resumed from), every step with its loss, every report's checksum, and each
rank's checksum of the full state it ended with; `kill` makes one rank
SIGKILL itself once; `until` (a path) runs the loop past `steps`, a report's
worth at a time, until that file exists, so a test decides when it ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import tempfile
import time

import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ray_elastic.train import Checkpoint, RunConfig, ScalingConfig
from ray_elastic.train.torch import TorchTrainer

DIM = 48


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class AppState(Stateful):
    """The model and optimizer as DCP saves them: sharded state dicts, and the step they were taken at."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int = 0) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self) -> dict:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optimizer_state, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.step = state["step"]


def shard_model(model: nn.Module, world_size: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full model and optimizer state on rank 0 (CPU), empty elsewhere: a collective, every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def checksum(*states: dict) -> str:
    """SHA-256 over every tensor's bytes and every other value, in key order: equal only if bitwise equal."""
    digest = hashlib.sha256()

    def feed(value) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                digest.update(str(key).encode())
                feed(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                feed(item)
        elif isinstance(value, torch.Tensor):
            digest.update(str(value.dtype).encode())
            digest.update(value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(value).encode())

    for state in states:
        feed(state)
    return digest.hexdigest()


def _log(config: dict, **record) -> None:
    with open(config["log"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "time": time.time(), **record}) + "\n")


def _go_on(config: dict, step: int) -> bool:
    """Whether the loop trains step `step` (0-based): `steps` of them, then, with `until`, more until its file exists.

    Past `steps` the ranks decide together (one allreduce) at each report's
    boundary, so they all stop after the same report.
    """
    if step < config["steps"]:
        return True
    if config.get("until") is None or step % config["report_every"]:
        return config.get("until") is not None
    seen = torch.tensor([float(os.path.exists(config["until"]))])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return not seen.item()


def _batch(step: int, rank: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(batch_size, DIM, generator=g)
    return x, x[:, :1].sin() + 0.1 * x[:, 1:2]


def train_func(config: dict) -> None:
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    torch.manual_seed(0)
    model = shard_model(Net(), world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])

    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as directory:
            app = AppState(model, optimizer)
            dcp.load({"app": app}, checkpoint_id=directory)
            start = app.step
    resumed = checksum(*full_state(model, optimizer)) if checkpoint else None
    node = ray.get_runtime_context().get_node_id()
    if rank == 0 or checkpoint is None:
        _log(config, entry=True, rank=rank, size=world_size, at=start, node=node, checksum=resumed)
    else:
        _log(config, entry=True, rank=rank, size=world_size, at=start, node=node)

    kill = config.get("kill")
    step = start
    while _go_on(config, step):
        if kill and rank == kill["rank"] and step == kill["step"] and not os.path.exists(kill["marker"]):
            with open(kill["marker"], "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step, rank, config["batch_size"])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _log(config, step=step + 1, rank=rank, size=world_size, loss=loss.item())
        time.sleep(config.get("step_sleep", 0.0))
        last = step + 1 == config["steps"] and config.get("until") is None
        if (step + 1) % config["report_every"] == 0 or last:
            digest = checksum(*full_state(model, optimizer))
            with tempfile.TemporaryDirectory() as directory:
                dcp.save({"app": AppState(model, optimizer, step + 1)}, checkpoint_id=directory)
                metrics = {"step": step + 1, "loss": loss.item(), "size": world_size}
                if rank == 0:
                    _log(config, report=step + 1, size=world_size, checksum=digest)
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))
        step += 1

    # every rank's own gather of the full state it ended with (not rank 0's alone, as `full_state` gives)
    everywhere = StateDictOptions(full_state_dict=True)
    mine = checksum(
        get_model_state_dict(model, options=everywhere), get_optimizer_state_dict(model, optimizer, options=everywhere)
    )
    _log(config, end=True, rank=rank, size=world_size, at=step, checksum=mine)
    model_state, _ = full_state(model, optimizer)
    with tempfile.TemporaryDirectory() as directory:
        final = None
        if rank == 0:
            torch.save(model_state, os.path.join(directory, "full-model.pt"))
            final = Checkpoint.from_directory(directory)
        ray.train.report({"step": step, "final": True}, checkpoint=final, checkpoint_dir_name="full_model")


def fit(config: dict, num_workers, storage_path: str, name: str = "fsdp"):
    trainer = TorchTrainer(
        train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(storage_path=storage_path, name=name),
    )
    return trainer.fit()
