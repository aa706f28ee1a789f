"""One rank of tests/integration/test_ring_fencing.py: rings abandoned while a member is silent, without Ray.

For each way tensors meet a ring (`PATHS`): ranks 0 and 1 are the survivors,
they start the collective, rank 2 (the cut-off one) does not join it, and
each survivor's control thread abandons the ring, as the driver's abandon
does. Only then does rank 2 join: as a node whose network healed, still
running its old generation's collective. Each path gets a ring of its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ray_elastic.collective import torch_dist
from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.exceptions import HorovodInternalError

WORLD = 3
N = 1 << 16  # 256 KiB of float32: more than one socket buffer, so a late sum arrives in pieces
SUM = torch_dist.ReduceOp.SUM


def _user_allreduce(group: TorchGlooGroup, t: torch.Tensor, rank: int) -> None:
    group.allreduce_(t, SUM)  # the user-level blocking call, on the user's own tensor


def _bucket(group: TorchGlooGroup, t: torch.Tensor, rank: int) -> None:
    group.allreduce_async(t, SUM).wait()  # a DistributedOptimizer bucket


def _ddp_future(group: TorchGlooGroup, t: torch.Tensor, rank: int) -> None:
    # what the DDP path's communication hook hands DDP's reducer
    group.abandonable_future("allreduce", lambda: dist.all_reduce(t, async_op=True), lambda: t).wait()


def _broadcast(group: TorchGlooGroup, t: torch.Tensor, rank: int) -> None:
    group.broadcast_(t, root_rank=2)  # a sync from the cut-off rank


def _transfer(group: TorchGlooGroup, t: torch.Tensor, rank: int) -> None:
    if rank == 2:  # TorchState's point-to-point transfer of a chunk to each survivor
        for dst in (0, 1):
            group.send_async(t, dst).wait()
    else:
        group.recv_async(t, 2).wait()


PATHS: dict[str, Callable[[TorchGlooGroup, torch.Tensor, int], None]] = {
    "user allreduce_": _user_allreduce,
    "optimizer bucket": _bucket,
    "DDP hook future": _ddp_future,
    "sync broadcast": _broadcast,
    "state transfer": _transfer,
}


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout:g} s")
        time.sleep(0.01)


def _one_path(rank: int, ctl: Path, name: str, collective: Callable) -> dict:
    group = TorchGlooGroup(dist.FileStore(str(ctl / "store"), WORLD), rank, WORLD, 60.0)
    group.allreduce_(torch.ones(8), SUM)  # the ring formed and worked
    mine = torch.full((N,), float(rank + 1))
    if rank == 2:  # cut off: comes back only once both survivors left the ring
        _wait_for(ctl / "abandoned-0")
        _wait_for(ctl / "abandoned-1")
        try:
            collective(group, mine, rank)
            outcome = "completed"
        except HorovodInternalError as e:
            outcome = f"failed: {e}"
        (ctl / "healed-done").touch()
        group.close()
        return {"outcome": outcome}
    abandon_took: list[float] = []

    def abandon_soon() -> None:
        time.sleep(0.3)  # let the collective block on the silent rank
        started = time.monotonic()
        group.abandon("rank 2 was lost (test)")
        abandon_took.append(time.monotonic() - started)
        (ctl / f"abandoned-{rank}").touch()

    threading.Thread(target=abandon_soon, daemon=True).start()
    try:
        collective(group, mine, rank)
        outcome = "completed"
    except HorovodInternalError as e:
        outcome = f"failed: {e}"
    # what the abandoned collective left (partial sums of the ring's own steps before the loss are expected)
    left = mine.clone()
    _wait_for(ctl / "healed-done")  # the cut-off rank ran its collective to its end
    group.close()
    return {
        "outcome": outcome,
        "abandon_took": abandon_took[0] if abandon_took else None,
        "untouched": bool(torch.equal(mine, left)),
    }


def rank_main(rank: int, control: str, out) -> None:
    torch.set_num_threads(1)
    found = {}
    for i, (name, collective) in enumerate(PATHS.items()):
        ctl = Path(control) / str(i)
        os.makedirs(ctl, exist_ok=True)
        found[name] = _one_path(rank, ctl, name, collective)
    out.put({"rank": rank, "paths": found, "late_completions": torch_dist.late_completions()})
