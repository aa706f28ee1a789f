"""`DistributedOptimizer` is a `torch.optim.Optimizer`: schedulers, GradScaler, clipping and its own API, no Ray.

A world of one on a real Gloo ring (the worker runtime's fixture): the
reduced gradients are the local ones, so every step must equal a plain
optimizer's bit for bit, and every scheduler must drive the same LR as it
does on the plain optimizer. The cluster tests check the same through
resets.
"""

from __future__ import annotations

import pytest
import torch
from test_worker_runtime import no_ray, world_of_one  # noqa: F401 - fixtures

from ray_elastic.horovod import torch as hvd
from ray_elastic.torch import DistributedOptimizer

SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 5], gamma=0.1),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1.0 / (1 + step)),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "warm-up then cosine (SequentialLR)": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=3), torch.optim.lr_scheduler.CosineAnnealingLR(o, 5)],
        milestones=[3],
    ),
}


def _pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    return model(x).pow(2).mean() + 0.1 * step  # never decreasing: ReduceLROnPlateau acts


@pytest.mark.parametrize("wrap", [DistributedOptimizer, hvd.DistributedOptimizer], ids=["ours", "horovod"])
@pytest.mark.parametrize("kind", list(SCHEDULERS))
@pytest.mark.usefixtures("world_of_one")
def test_every_scheduler_drives_the_wrapped_optimizer_as_it_drives_a_plain_one(wrap, kind):
    model, twin = _pair()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt = wrap(inner, named_parameters=model.named_parameters())
    plain = torch.optim.AdamW(twin.parameters(), lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    sched, plain_sched = SCHEDULERS[kind](opt), SCHEDULERS[kind](plain)
    for step in range(9):
        for m, o, s in ((model, opt, sched), (twin, plain, plain_sched)):
            o.zero_grad()
            loss = _loss(m, step)
            loss.backward()
            o.step()
            s.step(loss.item()) if kind == "ReduceLROnPlateau" else s.step()
        assert inner.param_groups[0]["lr"] == plain.param_groups[0]["lr"], f"{kind}: LR at step {step}"
    assert inner.param_groups[0]["lr"] != 0.1 or kind == "ReduceLROnPlateau", f"{kind} never changed the LR"
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [False, True], ids=["scaler.step", "synchronize+unscale_+clip"])
@pytest.mark.usefixtures("world_of_one")
def test_grad_scaler_on_the_reduced_gradients_skips_the_steps_a_plain_optimizer_skips(clip):
    model, twin = _pair()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    scalers = {id(o): torch.amp.GradScaler("cpu", init_scale=2.0**10) for o in (opt, plain)}
    for step in range(6):
        for m, o in ((model, opt), (twin, plain)):
            scaler = scalers[id(o)]
            o.zero_grad()
            loss = _loss(m, step) * (float("inf") if step == 2 else 1.0)  # one overflowing step
            scaler.scale(loss).backward()
            if clip:
                if o is opt:
                    opt.synchronize()
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            scaler.step(o)
            scaler.update()
        assert scalers[id(opt)].get_scale() == scalers[id(plain)].get_scale(), f"scale at step {step}"
    assert scalers[id(opt)].get_scale() < 2.0**10, "the inf step did not lower the scale"
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("world_of_one")
def test_unscale_and_clip_right_after_backward_act_on_the_gradients_the_step_uses():
    """The gradients are reduced when backward returns (as with DDP): no synchronize() is needed before unscale_."""
    model, twin = _pair()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    for m, o in ((model, opt), (twin, plain)):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        scaler.scale(_loss(m, 0)).backward()
        scaler.unscale_(o)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        scaler.step(o)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("world_of_one")
def test_synchronize_then_clip_then_step_steps_once_on_the_clipped_gradients():
    model, twin = _pair()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    for m, o in ((model, opt), (twin, plain)):
        o.zero_grad(set_to_none=False)
        _loss(m, 0).backward()
        if o is opt:
            opt.synchronize()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
        o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("world_of_one")
def test_state_dict_add_param_group_and_zero_grad_are_the_wrapped_optimizers():
    model, twin = _pair()
    extra, twin_extra = torch.nn.Linear(6, 1), torch.nn.Linear(6, 1)
    twin_extra.load_state_dict(extra.state_dict())
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = DistributedOptimizer(inner)
    plain = torch.optim.Adam(twin.parameters(), lr=0.01)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.05})
    plain.add_param_group({"params": twin_extra.parameters(), "lr": 0.05})
    for step in range(3):
        for m, e, o in ((model, extra, opt), (twin, twin_extra, plain)):
            o.zero_grad(set_to_none=step % 2 == 0)
            (_loss(m, step) + e(torch.ones(2, 6)).sum()).backward()
            o.step()
    for a, b in zip(
        [*model.parameters(), *extra.parameters()], [*twin.parameters(), *twin_extra.parameters()], strict=True
    ):
        assert torch.equal(a, b)
    saved = opt.state_dict()
    assert saved["param_groups"][1]["lr"] == 0.05 and len(saved["state"]) == 6
    groups = opt.param_groups
    opt.load_state_dict(plain.state_dict())
    assert opt.param_groups is inner.param_groups, "param_groups is no longer the wrapped optimizer's list"
    assert groups is not inner.param_groups  # torch's load_state_dict replaced the list: read through each time
