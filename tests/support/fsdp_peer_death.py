"""One rank of a two-process FSDP2 run on Gloo whose rank 1 dies at step 3, without Ray.

Run as `python fsdp_peer_death.py RANK STORE_FILE` (the ring meets in that file).

Rank 1 leaves with `os._exit` (as a SIGKILL: no goodbye, the kernel closes its
sockets). Rank 0 prints one JSON line: the type and message of the error
FSDP2's collectives raised, and whether `is_torch_ring_error` takes it for
the ring's.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ray_elastic.collective.torch_dist import is_torch_ring_error


def main(rank: int, store_path: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store_path}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
    )
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    outcome = {"kind": "finished", "message": "", "ring": False}
    try:
        for step in range(50):
            if rank == 1 and step == 3:
                os._exit(0)
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = {"kind": type(e).__name__, "message": str(e)[:300], "ring": is_torch_ring_error(e)}
    print(json.dumps(outcome), flush=True)
    os._exit(0)  # the broken process group's destructor may wait: this process is done


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
