"""A rank of integration/test_gloo_staging.py: a `TorchGlooGroup` over a file store (no Ray), its values staged or not.

`staged=True` makes the group treat CPU tensors as device tensors (`torch_gloo.on_host` answers False), so
every value goes through a host buffer and back, as a CUDA tensor's does; the results must be bitwise those of
the unstaged run.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ray_elastic.collective import torch_gloo
from ray_elastic.collective.base import Average, Max, Sum


def values(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(17 + rank)
    return {
        "f32": torch.randn(1000, generator=gen),
        "f64_2d": torch.randn(33, 7, generator=gen, dtype=torch.float64),
        "i64": torch.randint(-(2**40), 2**40, (513,), generator=gen),
    }


def run(rank: int, world: int, control: str, staged: bool, out) -> None:
    torch.set_num_threads(1)
    buffers: list[torch.Tensor] = []
    if staged:
        torch_gloo.on_host = lambda t: False
        make = torch_gloo.host_buffer

        def counted(like: torch.Tensor) -> torch.Tensor:
            buffers.append(make(like))
            return buffers[-1]

        torch_gloo.host_buffer = counted
    group = torch_gloo.TorchGlooGroup(dist.FileStore(os.path.join(control, "store"), world), rank, world, 30.0)
    found: dict = {"rank": rank}
    for name, t in values(rank).items():
        v = t.clone()
        group.allreduce_(v, Average if v.is_floating_point() else Sum)
        found[f"allreduce {name}"] = v.contiguous().numpy().tobytes()
        v = t.clone()
        work = group.allreduce_async(v, Max)
        work.wait()
        found[f"allreduce_async {name}"] = v.contiguous().numpy().tobytes()
        v = t.clone()
        group.broadcast_(v, world - 1)
        found[f"broadcast {name}"] = v.contiguous().numpy().tobytes()
        v = t.clone()
        if rank == 0:
            group.send_async(v, 1).wait()
        elif rank == 1:
            group.recv_async(v, 0).wait()
        found[f"send/recv {name}"] = v.contiguous().numpy().tobytes()
        found[f"allgather {name}"] = group.allgather(t.clone()).contiguous().numpy().tobytes()
    found["staged buffers"] = len(buffers)
    found["buffers on host"] = all(b.device.type == "cpu" for b in buffers)
    out.put(found)
    group.barrier()
    group.close()
