"""A rank of integration/test_ddp_cluster.py's reduction check: DDP over Gloo, and over our abandonable group (no Ray).

Our group in two variants: `ours` sums through shared memory (the ranks
share this machine), `ours_gloo` through Gloo (as on ranks of several machines).
"""

from __future__ import annotations

import hashlib
import os
import types

import torch
import torch.distributed as dist

from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.torch.ddp import _AbandonableGroup, _NoticeCarrier

# DDP options whose collectives differ: static_graph and find_unused_parameters reduce a used-parameter map too
OPTIONS = {"plain": {}, "static_graph": {"static_graph": True}, "find_unused": {"find_unused_parameters": True}}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # BatchNorm's buffers: DDP broadcasts rank 0's at every forward
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )


def _digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in tensors)).hexdigest()


def grads_of_both(rank: int, world: int, control: str, out) -> None:
    """Put {rank, option: {variant: digests}} for DDP over Gloo and DDP over `_AbandonableGroup`.

    Per variant: the reduced gradients after the second step (which reduces
    into the bucket views the first left as `.grad`; their digest and the
    tensors), the parameters after three SGD steps, and (ours) the
    host-change notices summed behind the first allreduce of each backward
    and whether the sums went through shared memory.
    """
    torch.set_num_threads(1)
    group = TorchGlooGroup(dist.FileStore(os.path.join(control, "store"), world), rank, world, 60.0)
    generator = torch.Generator().manual_seed(100 + rank)  # every rank its own batches
    batches = [(torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator))] * 3
    found: dict = {"rank": rank}
    for option, kwargs in OPTIONS.items():
        found[option] = {}
        for variant in ("ddp", "ours", "ours_gloo"):
            model = _model()
            owner = types.SimpleNamespace(_carrier=None)  # stands for ElasticDDP, which holds the forward's notice
            extra = {}
            if variant != "ddp":
                extra["process_group"] = ours = _AbandonableGroup(group, owner)
                if variant == "ours_gloo":
                    ours._shared = None
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, **kwargs, **extra)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            grads, notices = "", []
            for step, (x, y) in enumerate(batches):
                if variant != "ddp":
                    owner._carrier = carrier = _NoticeCarrier(int(rank == step), 1)  # rank `step` holds a notice
                    ddp.process_group.new_backward()
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                if step == 1:
                    grads = _digest([p.grad for p in model.parameters()])
                    tensors = [p.grad.numpy().copy() for p in model.parameters()]  # numpy: the queue pickles it
                opt.step()
                if variant != "ddp":
                    notices.append(carrier.reduced(group)[0])
            found[option][variant] = {
                "grads": grads,
                "grad_tensors": tensors,
                "params": _digest(list(model.parameters())),
                "notices": notices,
                "shared": variant != "ddp" and ddp.process_group._shared is not None,
            }
    out.put(found)
    group.barrier()
    group.close()
