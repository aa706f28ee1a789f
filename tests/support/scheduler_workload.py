"""The training of integration/test_schedulers_integration.py: one LR scheduler of each kind, each with its optimizer.

A model of `len(KINDS)` small parts; part k is trained by optimizer k (an
AdamW) under scheduler k, with a `GradScaler` and gradient clipping. On the `"optimizer"` path each optimizer is a
`DistributedOptimizer`; on the `"ddp"` path the model is `prepare_model`'s
and the optimizers are plain. Every scheduler and optimizer is kept in one
`TorchState`, committed every 5 steps. Rank 0 reports after each step the
LR of every optimizer and whether the objects the loop holds are still the
ones the state rolls back (the scheduler, and the optimizer it drives).
`lr_curve(n)` is the fault-free LR of each kind after each of n steps.
The batches come from `prepare_data_loader` over `SAMPLES` sample ids, and
rank 0 reports every rank's batch with each step (a ledger; no
`record_batch` anywhere).
The run ends `extra_steps` after the world first has `end_world` workers
past `signal_step`.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from workloads import _fire_faults

import ray_elastic as elastic

KINDS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[12, 30, 55], gamma=0.3),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=5000),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=60),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + 0.05 * step)),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=4, factor=0.7),
    "warm-up then cosine": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=10), torch.optim.lr_scheduler.CosineAnnealingLR(o, 80)],
        milestones=[10],
    ),
}
LR = 0.01
SAMPLES = 300  # sample ids in the prepared DataLoader


def _plateau_metric(step: int) -> float:
    return 1.0  # never improves: ReduceLROnPlateau lowers the LR every patience + 1 steps, by the step count alone


def _advance(sched, step: int) -> None:
    sched.step(_plateau_metric(step)) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else sched.step()


def lr_curve(steps: int) -> list[list[float]]:
    """Each kind's LR after 1, 2, ... `steps` fault-free steps, on a plain optimizer."""
    opts = [torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR) for _ in KINDS]
    scheds = [make(o) for make, o in zip(KINDS.values(), opts, strict=True)]
    curve = []
    for step in range(steps):
        for o, sched in zip(opts, scheds, strict=True):
            o.step()
            _advance(sched, step)
        curve.append([o.param_groups[0]["lr"] for o in opts])
    return curve


class Parts(torch.nn.Module):
    """One small linear part per scheduler kind."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in KINDS)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [part(x) for part in self.parts]


def _done(state, config: dict) -> bool:
    """The run's end: `extra_steps` after the world first had `end_world` workers past `signal_step`, and not
    before `min_epochs` epochs are complete.

    The epoch floor makes the run's length independent of how fast the cluster changes: a leave that comes soon
    after the signal would otherwise end the run inside its second epoch.
    """
    if elastic.size() == config["end_world"] and state.step >= config["signal_step"]:
        state.shrunk_at = state.step if state.shrunk_at is None else state.shrunk_at
        return state.step >= state.shrunk_at + config["extra_steps"] and state.epoch >= config.get("min_epochs", 0)
    return False


def scheduler_train_fn(config: dict) -> dict:
    torch.manual_seed(0)
    plain = Parts()
    ddp = config["path"] == "ddp"
    model = elastic.torch.prepare_model(plain) if ddp else plain
    inner = [torch.optim.AdamW(part.parameters(), lr=LR) for part in plain.parts]
    if ddp:
        opts = inner
    else:
        pairs = zip(inner, plain.parts, strict=True)
        opts = [elastic.torch.DistributedOptimizer(o, part.named_parameters()) for o, part in pairs]
    scheds = [make(o) for make, o in zip(KINDS.values(), opts, strict=True)]
    # a plain DataLoader of sample ids: the loop below never says which batches it trained
    samples = torch.utils.data.TensorDataset(torch.arange(SAMPLES))
    loader = elastic.torch.prepare_data_loader(torch.utils.data.DataLoader(samples, batch_size=2, shuffle=True))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)  # mixed precision's loss scaling, with clipping
    held = {f"opt{k}": o for k, o in enumerate(opts)} | {f"sched{k}": s for k, s in enumerate(scheds)}
    held["scaler"] = scaler
    state = elastic.torch.TorchState(model=model, loader=loader, **held, step=0, epoch=0, shrunk_at=None)
    started = time.monotonic()

    @elastic.run
    def train(state) -> dict:
        while not _done(state, config):
            loader.set_epoch(state.epoch)
            for (ids,) in loader:
                if time.monotonic() - started > config["deadline_s"]:
                    raise TimeoutError(f"training did not end within {config['deadline_s']} s")
                x = torch.randn(16, 8, generator=torch.Generator().manual_seed(int(ids.sum())))
                for o in opts:
                    o.zero_grad()
                scaler.scale(sum(out.pow(2).mean() for out in model(x))).backward()
                for o, part, sched in zip(opts, plain.parts, scheds, strict=True):
                    if not ddp:
                        o.synchronize()  # the reduced gradients, to unscale and clip (DDP reduced them in backward)
                    scaler.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(part.parameters(), 0.5)
                    scaler.step(o)
                    _advance(sched, state.step)
                scaler.update()
                state.step += 1
                same = all(getattr(state, name) is obj for name, obj in held.items())
                same = same and all(sched.optimizer is o for sched, o in zip(scheds, opts, strict=True))
                report = {"step": state.step, "epoch": state.epoch, "world_size": elastic.size(), "held": same}
                report["lrs"] = [o.param_groups[0]["lr"] for o in inner]
                report["trained"] = elastic.allgather_object(ids.tolist())  # every rank's batch of this step
                elastic.report(report)
                if elastic.rank() == 0 and state.step >= config["signal_step"] and elastic.size() == 4:
                    Path(config["signal_file"]).touch()
                _fire_faults(config, state.step)
                time.sleep(config.get("step_time", 0.02))
                if state.step % 5 == 0:
                    state.commit()
                else:
                    state.check_host_updates()
                if _done(state, config):
                    break
            else:
                state.epoch += 1  # the loader ran out: the epoch is complete
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in plain.parameters())).hexdigest()
        return {"steps": state.step, "world_size": elastic.size(), "digests": elastic.allgather_object(digest)}

    return train(state)
