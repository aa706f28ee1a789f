"""`shard_model`: FSDP2 on the elastic ring by a default policy, for `prepare_model(parallel_strategy="fsdp")`.

The policy is the documented FSDP2 way: `fully_shard` on each block, then on
the root. The blocks are the elements of the model's `nn.ModuleList`s (a
transformer's layers); a model without one has its direct children that
hold parameters taken as blocks. The mesh is one-dimensional over the
current generation's ring; after a reset the library moves the sharded
modules onto the next generation's mesh (`fsdp2.rebind`), so the model is
wrapped once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ray_elastic.collective.factory import TORCH_BACKENDS
from ray_elastic.runtime.process import current
from ray_elastic.torch.device import get_device
from ray_elastic.torch.sharded import fsdp2

# the fully_shard options prepare_model passes on; the mesh is the ring's
OPTIONS = ("mp_policy", "reshard_after_forward", "offload_policy")


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules the default policy shards before the root: the outermost `ModuleList`s' elements."""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                if id(block) not in seen and any(True for _ in block.parameters()):
                    found.append(block)
                    seen.update(id(m) for m in block.modules())
    if not found:
        found = [child for child in model.children() if any(True for _ in child.parameters())]
    return found


def check_options(options: dict[str, Any], device: torch.device) -> None:
    """Refuse, by name, the options the ring decides and the ones this device cannot honour."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"prepare_model(parallel_strategy='fsdp') takes parallel_strategy_kwargs {', '.join(OPTIONS)}; "
            f"got {', '.join(unknown)} (the mesh is the elastic ring's)"
        )
    offload = options.get("offload_policy")
    if offload is not None and getattr(offload, "pin_memory", False) and device.type == "cpu":
        raise ValueError(
            "CPUOffloadPolicy() pins host memory, which needs an accelerator: on the CPU pass "
            "CPUOffloadPolicy(pin_memory=False)"
        )
    reshard = options.get("reshard_after_forward", True)
    if not isinstance(reshard, bool):
        raise ValueError(
            f"reshard_after_forward={reshard!r}: only True or False (an int reshards to a smaller group, which "
            "does not survive a change of world size)"
        )


def shard_model(model: torch.nn.Module, world: int, device: torch.device, **options: Any) -> torch.nn.Module:
    """`fully_shard` `model`'s blocks, then `model`, over a one-dimensional mesh of `world` ranks on `device`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_options(options, device)
    mesh = init_device_mesh(device.type, (world,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def prepare(
    model: torch.nn.Module, move_to_device: bool, options: dict[str, Any], extra: dict[str, Any]
) -> torch.nn.Module:
    """`prepare_model(parallel_strategy="fsdp")`: FSDP2 over the current ring, checked before anything changes."""
    if extra:
        raise ValueError(
            f"prepare_model(parallel_strategy='fsdp') takes its options in parallel_strategy_kwargs, "
            f"got {sorted(extra)}"
        )
    if fsdp2.is_sharded(model) or isinstance(model, DistributedDataParallel):
        raise TypeError(f"prepare_model got a model already wrapped ({type(model).__name__}): pass the plain module")
    ctx = current()
    if ctx.backend not in TORCH_BACKENDS:
        raise ValueError(
            f"prepare_model(parallel_strategy='fsdp') needs a torch.distributed process group, but this run uses "
            f"backend={ctx.backend!r}: pass backend='gloo' (CPU) or 'nccl' (GPU), or leave backend='auto'"
        )
    device = get_device() if move_to_device else next(model.parameters()).device
    check_options(options, device)
    ring = ctx.joined().ring
    if move_to_device:
        model.to(device)
    return shard_model(model, ring.size, device, **options)
