"""An FSDP2 model in a `TorchState` at world 1 (one Gloo process group in this process, no Ray).

The rollback puts the user's own parameters and AdamW's moments back bitwise,
keeping their objects; sharded models this library cannot reshard are refused
by name when the state is built, before any training; every private name of
torch the reshard relies on exists in the installed torch.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist
from ring_runtime import RingRuntime
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.runtime.process import set_current
from ray_elastic.torch.optimizer import DistributedOptimizer
from ray_elastic.torch.sharded import fsdp2
from ray_elastic.torch.state import TorchState


@pytest.fixture
def world_of_one():
    ring = TorchGlooGroup(dist.HashStore(), 0, 1, 30.0)
    set_current(RingRuntime(ring))
    try:
        yield ring
    finally:
        set_current(None)
        ring.close()


def sharded_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    mesh = init_device_mesh("cpu", (1,))  # on the CPU also where a GPU is present
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p._local_tensor.detach().numpy().tobytes())
        for key, value in sorted(opt.state[p].items()):
            h.update(key.encode() + getattr(value, "_local_tensor", value).detach().reshape(-1).numpy().tobytes())
    h.update(repr([g["lr"] for g in opt.param_groups]).encode())
    return h.hexdigest()


def test_a_rollback_brings_the_users_sharded_model_and_optimizer_back(world_of_one) -> None:
    model = sharded_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = TorchState(model=model, optimizer=opt, scheduler=sched)
    state.sync()

    def train() -> None:
        opt.zero_grad()
        model(torch.randn(3, 6)).square().mean().backward()
        opt.step()
        sched.step()

    train()
    state.save()
    committed, params, moments = (
        digest(model, opt),
        list(model.parameters()),
        [opt.state[p]["exp_avg"] for p in model.parameters()],
    )
    train()
    assert digest(model, opt) != committed
    state.restore()
    assert digest(model, opt) == committed
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert all(opt.state[p]["exp_avg"] is m for p, m in zip(model.parameters(), moments, strict=True))
    state.sync()
    assert digest(model, opt) == committed
    train()  # trains on after the sync moved it onto the ring's mesh


def test_sharded_models_that_cannot_be_resharded_are_refused_by_name(world_of_one) -> None:
    model = sharded_model()
    wrapped = DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    with pytest.raises(fsdp2.ShardingRefused, match="DistributedOptimizer.*pass the plain optimizer"):
        TorchState(model=model, optimizer=wrapped)


def test_a_mesh_not_over_the_current_world_is_refused(world_of_one) -> None:
    model = sharded_model()
    assert fsdp2.refusal(model, 1) is None
    assert "mesh of 1 ranks, but the world has 2" in fsdp2.refusal(model, 2)


def test_fsdp1_is_refused_with_the_fsdp2_way_named(world_of_one) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))
    with pytest.raises(fsdp2.ShardingRefused, match="FSDP1.*fully_shard"):
        TorchState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize(("owner", "name"), fsdp2.PRIVATE_NAMES)
def test_the_private_names_the_reshard_uses_exist_in_this_torch(world_of_one, owner, name) -> None:
    model = sharded_model()
    torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()  # lazy init done: every attribute is set
    objects = {
        "FSDPModule": model,
        "FSDPParam": fsdp2.fsdp_params(model)[0],
        "FSDPParamGroup": fsdp2._param_groups(model[0])[0],
        "DTensor": next(model.parameters()),
    }
    assert hasattr(objects[owner], name), f"torch {torch.__version__}: {owner}.{name} is gone"


class Blocks(torch.nn.Module):
    """A transformer's shape: an embedding, a list of blocks, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(6, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def test_prepare_model_fsdp_shards_each_block_then_the_root_and_trains_through_a_rollback(world_of_one) -> None:
    """bf16 mixed precision, no reshard after forward, CPU offload, clipping, a GradScaler and a scheduler."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

    from ray_elastic.torch import prepare_model

    torch.manual_seed(0)
    model = prepare_model(
        Blocks(),
        parallel_strategy="fsdp",
        parallel_strategy_kwargs={
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "reshard_after_forward": False,
            "offload_policy": CPUOffloadPolicy(pin_memory=False),
        },
    )
    assert [n for n, m in model.named_modules() if isinstance(m, FSDPModule)] == [
        "",
        "layers.0",
        "layers.1",
        "layers.2",
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = TorchState(model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    state.sync()

    def train() -> None:
        opt.zero_grad()
        scaler.scale(model(torch.randn(4, 6)).float().square().mean()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # DTensor gradients
        scaler.step(opt)
        scaler.update()
        sched.step()

    train()
    state.save()
    committed, scale = digest(model, opt), scaler.get_scale()
    train()
    scaler.update(scale * 4)  # the scaler moves on too: the rollback must bring it back
    state.restore()
    assert digest(model, opt) == committed and scaler.get_scale() == scale
    state.sync()
    train()


def test_prepare_model_fsdp_refuses_what_it_cannot_honour_before_sharding(world_of_one) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from ray_elastic.torch import prepare_model

    model = Blocks()
    with pytest.raises(ValueError, match="CPUOffloadPolicy\\(pin_memory=False\\)"):
        prepare_model(model, parallel_strategy="fsdp", parallel_strategy_kwargs={"offload_policy": CPUOffloadPolicy()})
    with pytest.raises(ValueError, match="only True or False"):
        prepare_model(model, parallel_strategy="fsdp", parallel_strategy_kwargs={"reshard_after_forward": 2})
    with pytest.raises(ValueError, match="mesh is the elastic ring's"):
        prepare_model(model, parallel_strategy="fsdp", parallel_strategy_kwargs={"mesh": None})
    assert not fsdp2.is_sharded(model), "a refused call sharded the model anyway"


def test_checkpoint_dir_keeps_the_sharded_commits_in_dcp_format_and_a_new_run_resumes_from_the_newest(
    world_of_one, tmp_path
) -> None:
    from types import SimpleNamespace

    from ray_elastic.runtime.checkpoint_cadence import CheckpointCadence

    settings = SimpleNamespace(
        checkpoint_dir=str(tmp_path), checkpoint_keep=1, checkpoint_timeout=30.0, checkpoint_every=1, run_id="r"
    )
    driver = SimpleNamespace(tell=SimpleNamespace(remote=lambda message: None))
    slot = SimpleNamespace(rank=0, size=1)
    model = sharded_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = TorchState(model=model, optimizer=opt, step=0)
    state.sync()
    cadence = CheckpointCadence("w0", driver, settings)
    for commit in (1, 2, 3):
        model(torch.randn(3, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        state.step = commit
        state.save()
        cadence.after_commit(state, slot, generation=1, commits=commit)
    assert cadence.flush() is None
    written = digest(model, opt)
    kept = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert kept == ["commit-00000002", "commit-00000003"], "the newest (and the one before, for the manifest)"
    assert (tmp_path / "sharded" / "commit-00000003" / ".metadata").exists()

    torch.manual_seed(9)  # a new run: other weights, no optimizer state yet
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    mesh = init_device_mesh("cpu", (1,))
    for block in fresh:
        fully_shard(block, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    resumed = TorchState(model=fresh, optimizer=fresh_opt, step=0)
    meta = CheckpointCadence("w0", driver, settings).maybe_resume(resumed, slot, ever_synced=False)
    assert meta is not None and meta["commit"] == 3
    resumed.sync()
    assert digest(fresh, fresh_opt) == written and resumed.step == 3


def test_a_two_dimensional_mesh_hsdp_is_refused_by_name(world_of_one) -> None:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(fsdp2.ShardingRefused, match="2-D mesh \\(HSDP or tensor parallel\\)"):
        TorchState(model=model, optimizer=torch.optim.AdamW(model.parameters()))
