"""FSDP2 on NCCL at world 1, in a `TorchState`: a rollback and a sync keep every tensor on its device, bitwise.

One process, one GPU, no Ray: the ring is `TorchNcclGroup` over a local store,
the model is sharded with `fully_shard` on CUDA with bf16 mixed precision,
AdamW steps it under a `GradScaler`-free bf16 loop and a scheduler. A step
after the commit is rolled back; the sync (the run's first, and one after a
commit) moves nothing and leaves the parameters, AdamW's moments (CUDA) and
its `step` (CPU, torch's rule) where they were.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _digest(model, opt) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p._local_tensor.detach().float().cpu().numpy().tobytes())
        for key, value in sorted(opt.state[p].items()):
            local = getattr(value, "_local_tensor", value)
            h.update(key.encode() + local.detach().float().cpu().reshape(-1).numpy().tobytes())
    h.update(repr([g["lr"] for g in opt.param_groups]).encode())
    return h.hexdigest()


def _devices(model, opt) -> set[tuple[str, str]]:
    out = set()
    for p in model.parameters():
        out.add(("param", p._local_tensor.device.type))
        for key, value in opt.state[p].items():
            out.add((key, getattr(value, "_local_tensor", value).device.type))
    return out


def test_fsdp2_on_nccl_rolls_back_and_syncs_on_its_devices(monkeypatch) -> None:
    import torch.distributed as dist
    from ring_runtime import RingRuntime
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ray_elastic.collective.nccl import TorchNcclGroup
    from ray_elastic.runtime.process import set_current
    from ray_elastic.torch.sharded.handler import ShardedHandler
    from ray_elastic.torch.state import TorchState

    ring = TorchNcclGroup(dist.HashStore(), 0, 1, 60.0, 0)

    set_current(RingRuntime(ring, backend="nccl"))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        state = TorchState(model=model, optimizer=opt, scheduler=sched, step=0)
        assert isinstance(state._handlers["model"], ShardedHandler)

        def train() -> None:
            opt.zero_grad()
            model(torch.randn(32, 256, device="cuda")).float().square().mean().backward()
            opt.step()
            sched.step()

        state.sync()
        for _ in range(3):
            train()
        state.step = 3
        state.save()
        committed = _digest(model, opt)
        assert _devices(model, opt) == {("param", "cuda"), ("exp_avg", "cuda"), ("exp_avg_sq", "cuda"), ("step", "cpu")}
        train()
        assert _digest(model, opt) != committed
        state.restore()
        assert _digest(model, opt) == committed, "the rollback did not bring the sharded state back bitwise"
        state.sync()
        assert _digest(model, opt) == committed, "a sync at world 1 changed the state"
        assert _devices(model, opt) == {("param", "cuda"), ("exp_avg", "cuda"), ("exp_avg_sq", "cuda"), ("step", "cpu")}
        train()  # the model still trains on the mesh it was moved onto
        assert torch.isfinite(next(model.parameters())._local_tensor).all()
    finally:
        set_current(None)
        ring.close()
