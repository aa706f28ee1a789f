"""A rank of integration/test_gloo_staging.py: a `TorchGlooGroup` over a file store (no Ray), its values staged or not.

`mode` is what the group takes the CPU tensors for:
- "host": host tensors, used in place;
- "device": tensors on a device torch's Gloo does not stage (`torch_gloo.on_host` answers False), so every
  value goes through a host buffer of ours and back;
- "cuda": CUDA tensors (`torch_gloo.torch_stages` answers True as well), so allreduce and broadcast are
  handed to torch's Gloo as they are, and only the other operations go through our host buffers.
The results must be bitwise those of the "host" run; `found["staged"]` counts our host buffers per operation.
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


def run(rank: int, world: int, control: str, mode: str, out) -> None:
    torch.set_num_threads(1)
    buffers: list[torch.Tensor] = []
    if mode != "host":
        torch_gloo.on_host = lambda t: False
        make = torch_gloo.host_buffer

        def counted(like: torch.Tensor) -> torch.Tensor:
            buffers.append(make(like))
            return buffers[-1]

        torch_gloo.host_buffer = counted
    if mode == "cuda":
        torch_gloo.torch_stages = lambda t: True
    group = torch_gloo.TorchGlooGroup(dist.FileStore(os.path.join(control, "store"), world), rank, world, 30.0)
    found: dict = {"rank": rank}
    staged: dict[str, int] = {}

    def counting(op: str, result: torch.Tensor) -> bytes:
        staged[op] = staged.get(op, 0) + len(buffers)
        buffers.clear()
        return result.contiguous().numpy().tobytes()

    for name, t in values(rank).items():
        v = t.clone()
        group.allreduce_(v, Average if v.is_floating_point() else Sum)
        found[f"allreduce {name}"] = counting("allreduce", v)
        v = t.clone()
        work = group.allreduce_async(v, Max)
        work.wait()
        found[f"allreduce_async {name}"] = counting("allreduce_async", v)
        v = t.clone()
        group.broadcast_(v, world - 1)
        found[f"broadcast {name}"] = counting("broadcast", v)
        v = t.clone()
        if rank == 0:
            group.send_async(v, 1).wait()
        elif rank == 1:
            group.recv_async(v, 0).wait()
        found[f"send/recv {name}"] = counting("send/recv", v)
        found[f"allgather {name}"] = counting("allgather", group.allgather(t.clone()))
    found["staged"] = staged
    out.put(found)
    group.barrier()
    group.close()
