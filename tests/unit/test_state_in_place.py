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
