"""One rank of tests/test_ddp.py's reduction check: DDP over Gloo as it is, and over our abandonable group (no Ray)."""

from __future__ import annotations

import hashlib
import os
import types

import torch
import torch.distributed as dist

from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.torch.ddp import _AbandonableGroup


def grads_of_both(rank: int, world: int, control: str, out) -> None:
    """Put {rank, variant: digest of the reduced gradients} for DDP over Gloo and DDP over `_AbandonableGroup`."""
    torch.set_num_threads(1)
    group = TorchGlooGroup(dist.FileStore(os.path.join(control, "store"), world), rank, world, 60.0)
    generator = torch.Generator().manual_seed(100 + rank)  # every rank its own batch
    x, y = torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)
    found = {"rank": rank}
    for variant in ("ddp", "ours"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        kwargs = {}
        if variant == "ours":
            owner = types.SimpleNamespace(_carrier=None)  # stands for ElasticDDP: no notice to carry
            kwargs["process_group"] = _AbandonableGroup(group, owner)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, **kwargs)
        for _ in range(2):  # the second step reduces into the bucket views the first one left as .grad
            ddp.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        found[variant] = hashlib.sha1(flat.numpy().tobytes()).hexdigest()
    out.put(found)
    group.barrier()
    group.close()
