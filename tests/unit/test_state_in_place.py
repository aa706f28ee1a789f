"""TorchState rolls back the user's own objects in place: schedulers, GradScaler, EMA, their own class, RNGs.

Without a cluster: `save()` is the commit and `restore()` the rollback a
failure brings. Before (issue 35) a scheduler was deep-copied: after a
restore `state.scheduler` was a copy driving a copy of the optimizer, and
the optimizer the loop held never changed its LR again.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_optimizer_work import Ops

from ray_elastic.torch import RngState
from ray_elastic.torch.state import TorchState


def _model_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched) -> None:
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    sched.step()


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1.0, total_steps=20),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2), torch.optim.lr_scheduler.ExponentialLR(o, 0.9)],
            milestones=[2],
        ),
    ],
    ids=["StepLR", "OneCycleLR", "SequentialLR"],
)
def test_a_rollback_restores_the_users_scheduler_object_and_it_keeps_driving_the_real_optimizer(make):
    model, opt = _model_opt()
    sched = make(opt)
    state = TorchState(model=model, optimizer=opt, scheduler=sched, step=0)
    for _ in range(3):
        _step(model, opt, sched)
    state.save()
    committed_lr, committed_epoch = opt.param_groups[0]["lr"], sched.last_epoch
    for _ in range(4):
        _step(model, opt, sched)
    assert opt.param_groups[0]["lr"] != committed_lr
    state.restore()
    assert state.scheduler is sched, "the state's scheduler was replaced by a copy"
    assert sched.last_epoch == committed_epoch and opt.param_groups[0]["lr"] == committed_lr
    # the rolled-back scheduler goes on driving the optimizer the loop holds, as a fault-free run's does
    twin_model, twin_opt = _model_opt()
    twin_sched = make(twin_opt)
    for _ in range(3 + 5):
        _step(twin_model, twin_opt, twin_sched)
    for _ in range(5):
        _step(model, opt, sched)
    assert opt.param_groups[0]["lr"] == twin_opt.param_groups[0]["lr"]


def test_a_grad_scaler_and_a_users_own_class_roll_back_in_place():
    class Ema:  # a user's own class: state_dict()/load_state_dict() is all it takes
        def __init__(self) -> None:
            self.value = torch.zeros(3)
            self.updates = 0

        def update(self, x: torch.Tensor) -> None:
            self.value.mul_(0.9).add_(x, alpha=0.1)
            self.updates += 1

        def state_dict(self) -> dict:
            return {"value": self.value, "updates": self.updates}

        def load_state_dict(self, d: dict) -> None:
            self.value.copy_(d["value"])
            self.updates = d["updates"]

    scaler, ema = torch.amp.GradScaler("cpu", init_scale=8.0), Ema()
    scaler.scale(torch.ones(1))  # the scale tensor exists from the first scale() on
    held_tensor = ema.value
    state = TorchState(scaler=scaler, ema=ema)
    ema.update(torch.ones(3))
    state.save()
    committed = ema.value.clone()
    scaler.update(new_scale=2.0)
    ema.update(torch.full((3,), 5.0))
    state.restore()
    assert state.scaler is scaler and state.ema is ema and ema.value is held_tensor
    assert scaler.get_scale() == 8.0 and ema.updates == 1 and torch.equal(ema.value, committed)


def test_rng_true_replays_the_draws_after_a_rollback():
    state = TorchState(rng=True, step=0)
    assert isinstance(state.rng, RngState)
    state.save()
    first = (torch.rand(3), np.random.rand(), random.random())
    state.restore()
    again = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_plain_values_keep_their_deep_copy():
    history = [1, 2]
    state = TorchState(history=history)
    history.append(3)
    state.restore()
    assert state.history == [1, 2] and state.history is not history


def test_an_averaged_model_rolls_back_in_place():
    model, opt = _model_opt()
    swa = torch.optim.swa_utils.AveragedModel(model)
    state = TorchState(model=model, optimizer=opt, swa=swa)
    swa.update_parameters(model)
    state.save()
    committed = [p.clone() for p in swa.parameters()]
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    swa.update_parameters(model)
    assert int(swa.n_averaged) == 2
    state.restore()
    assert state.swa is swa and int(swa.n_averaged) == 1
    assert all(torch.equal(a, b) for a, b in zip(swa.parameters(), committed, strict=True))


def test_a_rollback_between_a_grad_scalers_step_and_its_update_lets_the_redone_step_unscale():
    """A failure after scaler.step(opt) and before scaler.update(): the redone step must not find opt 'stepped'."""
    model, opt = _model_opt()
    scaler = torch.amp.GradScaler("cpu")
    state = TorchState(model=model, optimizer=opt, scaler=scaler)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    scaler.step(opt)  # ... and the ring fails before scaler.update()
    state.restore()
    opt.zero_grad()
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    scaler.unscale_(opt)  # raised "unscale_() is being called after step()" before
    scaler.step(opt)
    scaler.update()


def test_a_grad_scalers_commit_and_rollback_read_no_tensor_and_the_users_scaler_rolls_back():
    """A GradScaler's state_dict() reads its scale with .item(): a commit must not (a device wait per commit)."""
    model, opt = _model_opt()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()  # a finite step with growth_interval=1: the scale doubles
    state = TorchState(model=model, optimizer=opt, scaler=scaler)
    scale, tracker = scaler._scale, scaler._growth_tracker
    with Ops() as ops:  # a read (`.item()`) is `_local_scalar_dense`: on a GPU it waits for every queued kernel
        state.save()
        scaler.update(new_scale=1.0)
        scaler.set_growth_factor(3.0)
        state.restore()
    reads = ops.calls["aten._local_scalar_dense"]
    assert reads == 0, f"{reads} tensor reads (device waits) in a commit and rollback"
    assert scaler._scale is scale and scaler._growth_tracker is tracker, "the scaler's tensors were replaced"
    assert scaler.get_scale() == 2.0**9 and scaler.get_growth_factor() == 2.0
    # the durable checkpoint is the state dict of host numbers, as torch writes it
    assert state._handlers["scaler"].snapshot() == scaler.state_dict()


def test_a_grad_scaler_whose_tensors_are_on_another_device_commits_and_rolls_back_there():
    """`meta` stands in for CUDA: `.item()` on it raises, as a device wait in a commit would cost."""
    scaler = torch.amp.GradScaler("cpu")
    scaler._lazy_init_scale_growth_tracker(torch.device("meta"))
    state = TorchState(scaler=scaler)
    scale = scaler._scale
    state.save()
    state.restore()
    assert scaler._scale is scale and scaler._scale.device.type == "meta"
