"""An FSDP2 model (`fully_shard` on each block and on the root) in a `TorchState`, for the sharded cluster tests.

`fsdp_train_fn` builds the model on the current ring inside `train_fn` (a
newcomer builds its own, with other weights: the sync gives it its rows),
with AdamW and a StepLR scheduler, and trains on synthetic data whose
target is a fixed function, so the loss falls. It commits every
`commit_every` steps and checks for host updates only there, so a graceful
reset keeps a committed state too.

What it tells the test:
- `elastic.report` of rank 0: every step's loss; every commit's digest (a
  SHA-256 over the full model and optimizer state, gathered from the shards
  with `get_model_state_dict` / `get_optimizer_state_dict`,
  `full_state_dict=True`, on every rank) as `{"commit": step, "digest": ...}`;
  every entry into the loop (after each sync) as `{"entry": generation,
  "step": ..., "digest": ..., "ranks": [...]}` with each rank's pid, node,
  the bytes it received in the reshard, its shard's bytes, and the plan's
  bytes moved and minimum.
- a JSON line per entry in `config["log"]` (rank 0 writes it, after the
  reports so far reached the driver), so the test can wait on the world.

Control from the test, by files: `config["kill"]` (rank 1 SIGKILLs itself
at its next non-commit step once that file exists; it writes the time into
`kill + ".done"` first), `config["stop"]` (the ranks stop at the next commit
once it exists, then train `extra_steps` more).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard

import ray_elastic as elastic
from ray_elastic.runtime import current

DIM = 64
FULL = StateDictOptions(full_state_dict=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def full_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the full model and optimizer state and the learning rates: a collective, every rank calls it."""
    h = hashlib.sha256()
    for name, t in sorted(get_model_state_dict(model, options=FULL).items()):
        h.update(name.encode() + t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)
    for name, values in sorted(optim["state"].items()):
        for key, t in sorted(values.items()):
            h.update(f"{name}.{key}".encode() + t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr([g["lr"] for g in optimizer.param_groups]).encode())
    return h.hexdigest()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, DIM, generator=g)
    return x, x[:, :1].sin() + 0.5 * x[:, 1:2]


def _wait_shipped() -> None:
    ctx = current()
    deadline = time.monotonic() + 30
    while not ctx.metrics.delivered() and time.monotonic() < deadline:
        time.sleep(0.01)


def fsdp_train_fn(config: dict) -> dict:
    import ray

    torch.set_num_threads(1)
    torch.manual_seed(os.getpid())  # every rank, newcomers too, starts with weights of its own: the sync decides
    model = Net()
    # joins the ring first: fully_shard's default mesh needs torch.distributed's default group, which a worker
    # creates when it joins its first generation (a newcomer: the one that takes it in)
    elastic.size()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the head's parameters are the root's own
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.9)
    state = elastic.torch.TorchState(model=model, optimizer=optimizer, scheduler=scheduler, step=0, stop_at=-1)
    sharded = state._handlers["model"]
    node = ray.get_runtime_context().get_node_id()
    started = time.monotonic()
    every = config.get("commit_every", 5)

    @elastic.run
    def train(state) -> dict:
        digest = full_digest(model, optimizer)
        plan = sharded.last_plan
        mine = {
            "pid": os.getpid(),
            "node": node,
            "received": sum(p.nbytes for p in plan.receives(elastic.rank())) if plan else 0,
            # this rank's rows of every sharded tensor (parameters and AdamW's moments) in the new layout
            "shard": sum(t.numel() * t.element_size() for t in sharded._live(sharded.layout())),
        }
        ranks = elastic.allgather_object(mine)
        entry = {
            "entry": current().generation,
            "step": state.step,
            "digest": digest,
            "world_size": elastic.size(),
            "ranks": ranks,
            "moved": plan.bytes_moved if plan else 0,
            "minimum": plan.minimum_bytes if plan else 0,
            "reshard_s": sharded.last_reshard_s,
        }
        elastic.report(entry)
        if elastic.rank() == 0:
            _wait_shipped()
            with open(config["log"], "a") as f:
                f.write(json.dumps({**entry, "time": time.time()}) + "\n")
        while state.stop_at < 0 or state.step < state.stop_at:
            if time.monotonic() - started > config.get("deadline_s", 150):
                raise TimeoutError("the sharded workload did not finish within its deadline")
            commit_step = (state.step + 1) % every == 0
            if elastic.rank() == 1 and not commit_step and os.path.exists(config["kill"]):
                try:
                    fd = os.open(config["kill"] + ".done", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    pass
                else:
                    with os.fdopen(fd, "w") as f:
                        f.write(str(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
            x, y = _batch(state.step, elastic.rank())
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            state.step += 1
            elastic.report({"step": state.step, "loss": loss.item(), "world_size": elastic.size()})
            time.sleep(config.get("step_sleep", 0.02))
            if commit_step:
                if state.stop_at < 0 and elastic.broadcast_object(os.path.exists(config["stop"])):
                    state.stop_at = state.step + config.get("extra_steps", 10)
                elastic.report({"commit": state.step, "digest": full_digest(model, optimizer)})
                state.commit()
        final = full_digest(model, optimizer)
        return {"steps": state.step, "world_size": elastic.size(), "digests": elastic.allgather_object(final)}

    return train(state)
