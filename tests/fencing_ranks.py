"""One rank of tests/test_ring_fencing.py: a ring abandoned while a member is silent, without Ray.

Ranks 0 and 1 are the survivors: they start a collective, rank 2 (the
cut-off one) does not join it, and each survivor's control thread abandons
the ring, as the driver's abandon does. Only then does rank 2 join: as a
node whose network healed, with its old generation's collective.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ray_elastic.collective import torch_dist
from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.exceptions import HorovodInternalError

WORLD = 3
N = 1 << 16  # 256 KiB of float32: more than one socket buffer, so a late sum arrives in pieces


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:g} s")
        time.sleep(0.01)


def rank_main(rank: int, control: str, out) -> None:
    torch.set_num_threads(1)
    ctl = Path(control)
    group = TorchGlooGroup(dist.FileStore(os.path.join(control, "store"), WORLD), rank, WORLD, 60.0)
    healthy = torch.full((N,), float(rank + 1))
    group.allreduce_(healthy, torch_dist.ReduceOp.SUM)  # the ring formed and worked
    mine = torch.full((N,), float(rank + 1))
    if rank == 2:  # cut off: comes back only once both survivors left the ring
        _wait_for(ctl / "abandoned-0")
        _wait_for(ctl / "abandoned-1")
        try:
            group.allreduce_(mine, torch_dist.ReduceOp.SUM)
            outcome = "completed"
        except HorovodInternalError as e:
            outcome = f"failed: {e}"
        (ctl / "healed-done").touch()
        out.put({"rank": rank, "outcome": outcome})
        return
    abandon_took: list[float] = []

    def abandon_soon() -> None:
        time.sleep(0.3)  # let the collective block on the silent rank
        started = time.monotonic()
        group.abandon("rank 2 was lost (test)")
        abandon_took.append(time.monotonic() - started)
        (ctl / f"abandoned-{rank}").touch()

    threading.Thread(target=abandon_soon, daemon=True).start()
    try:
        if rank == 0:  # the user-level blocking call, on the user's own tensor
            group.allreduce_(mine, torch_dist.ReduceOp.SUM)
        else:  # a gradient bucket's asynchronous allreduce
            group.allreduce_async(mine, torch_dist.ReduceOp.SUM).wait()
        outcome = "completed"
    except HorovodInternalError as e:
        outcome = f"failed: {e}"
    # what the abandoned collective left (partial sums of the ring's own steps before the loss are expected)
    left = mine.clone()
    _wait_for(ctl / "healed-done")  # the cut-off rank ran its collective to its end
    group.close()
    out.put(
        {
            "rank": rank,
            "outcome": outcome,
            "abandon_took": abandon_took[0] if abandon_took else None,
            "untouched": bool(torch.equal(mine, left)),
            "late_completions": torch_dist.late_completions(),
        }
    )
