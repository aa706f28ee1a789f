"""One rank of integration/test_shm_allreduce.py: a `TorchGlooGroup` over a file store and its shared ring (no Ray)."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from ray_elastic.collective import shm
from ray_elastic.collective.base import Sum
from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.exceptions import HorovodInternalError

# (dtype, elements): one piece, several pieces of a slot (the test shrinks slots to 64 KiB), an empty tensor
CASES = [
    (torch.float32, 1000),
    (torch.float32, 70_001),
    (torch.float64, 20_000),
    (torch.int64, 9_000),
    (torch.int32, 0),
]


def inputs(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + n)
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-(2**20), 2**20, (n,), generator=gen, dtype=dtype)


def expected_sum(world: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Every rank's input added in rank order, as the ring's slices are."""
    total = inputs(0, dtype, n).clone()
    for r in range(1, world):
        total += inputs(r, dtype, n)
    return total


def _group(rank: int, world: int, control: str, shm_dir: str) -> TorchGlooGroup:
    torch.set_num_threads(1)
    shm.SHM_DIR = shm_dir  # this test's own directory: it can check that nothing is left in it
    shm.SLOT_BYTES = 64 * 2**10
    return TorchGlooGroup(dist.FileStore(os.path.join(control, "store"), world), rank, world, 30.0)


def sums(rank: int, world: int, control: str, shm_dir: str, out) -> None:
    """Put {case: result's bytes} and what was left in the shared directory after the build."""
    group = _group(rank, world, control, shm_dir)
    ring = group.shared_ring()
    group.barrier()  # every rank's build is over
    found: dict = {"rank": rank, "built": ring is not None, "left": sorted(os.listdir(shm_dir))}
    for dtype, n in CASES:
        t = inputs(rank, dtype, n)
        ring.allreduce_sum_(t)
        found[(str(dtype), n)] = t.numpy().tobytes()
    out.put(found)
    group.barrier()
    group.close()


def unshared(rank: int, world: int, control: str, shm_dir: str, out) -> None:
    """Rank 1 sees another machine: nobody builds a ring, and Gloo still sums."""
    if rank == 1:
        shm.machine_key = lambda: "another machine"
    group = _group(rank, world, control, shm_dir)
    ring = group.shared_ring()
    group.barrier()  # every rank's build is over
    value = torch.full((4,), float(rank + 1))
    group.allreduce_(value, op=Sum)
    out.put({"rank": rank, "built": ring is not None, "gloo_sum": value.tolist(), "left": os.listdir(shm_dir)})
    group.close()


def peer_lost(rank: int, world: int, control: str, shm_dir: str, how: str, out) -> None:
    """The last rank leaves before the second sum: exits (`how="exit"`) or stalls alive (`"stall"`).

    The others time their second sum and put the error it raised; under
    "stall" a timer abandons their group 1 s in, standing for the driver.
    """
    group = _group(rank, world, control, shm_dir)
    ring = group.shared_ring()
    ring.allreduce_sum_(torch.ones(10))
    if rank == world - 1:
        if how == "exit":
            os._exit(0)  # its sockets close, as on a SIGKILL
        time.sleep(6)  # alive, links open, never arrives
        os._exit(0)
    if how == "stall":
        threading.Timer(1.0, group.abandon, args=("the driver lost rank 2",)).start()
    started = time.monotonic()
    try:
        ring.allreduce_sum_(torch.ones(10))
        error = None
    except HorovodInternalError as e:
        error = str(e)
    took = time.monotonic() - started
    try:
        ring.allreduce_sum_(torch.ones(10))
        again = None
    except HorovodInternalError as e:
        again = str(e)
    out.put({"rank": rank, "error": error, "took": took, "again": again})
