"""Which GPU a worker drives, and which backend a generation's ring runs when its ranks' GPUs are known.

Ray hands each GPU worker its GPU ids (`ray.get_gpu_ids()`) and, unless
told otherwise, narrows `CUDA_VISIBLE_DEVICES` to them: the GPU Ray gave the
worker is then `cuda:0` in its process, whatever its local rank.
`device_index` maps the ids to the process's CUDA index; local rank is the
fallback only where Ray assigned none (a process outside a Ray actor).

NCCL allows one rank per GPU: two ranks on one GPU fail at their first
collective ("Duplicate GPU detected"). Workers asking for a fraction of a
GPU (`resources_per_worker={"GPU": 0.5}`) may be packed onto one, so before
a ring of GPU workers forms, every rank posts its `(node, GPU ids)` and the
ranks plan the backend from all of them (`plan_backend`, pure): with
`backend="auto"` a shared GPU means torch Gloo (CUDA tensors staged through
host memory, see `torch_gloo`), with `backend="nccl"` it is an error naming
the workers, the GPU and the rule. Every rank reads the same posts, so
every rank plans the same backend.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray_elastic.exceptions import DeviceConflictError

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


@dataclass(frozen=True)
class GpuSeat:
    """Where one rank's GPUs are: its worker, its node, and the GPU ids Ray gave it there."""

    worker_id: str
    node_id: str
    gpu_ids: tuple[str, ...]

    def encode(self) -> bytes:
        return json.dumps({"worker": self.worker_id, "node": self.node_id, "gpus": list(self.gpu_ids)}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> GpuSeat:
        d = json.loads(raw)
        return cls(str(d["worker"]), str(d["node"]), tuple(str(g) for g in d["gpus"]))


@dataclass(frozen=True)
class BackendPlan:
    """The backend a generation's ring runs, and why (`reason` is empty when it is the one asked for)."""

    backend: str
    reason: str = ""


def shared_gpus(seats: Mapping[int, GpuSeat]) -> dict[tuple[str, str], list[int]]:
    """The GPUs (node, GPU id) that more than one rank holds, with those ranks in order."""
    holders: dict[tuple[str, str], list[int]] = {}
    for rank in sorted(seats):
        seat = seats[rank]
        for gpu in dict.fromkeys(seat.gpu_ids):
            holders.setdefault((seat.node_id, gpu), []).append(rank)
    return {gpu: ranks for gpu, ranks in holders.items() if len(ranks) > 1}


def plan_backend(resolved: str, requested: str, seats: Mapping[int, GpuSeat]) -> BackendPlan:
    """The backend for a ring whose ranks sit on `seats` (rank -> seat).

    `resolved` is what the run's options resolved to ("nccl" for GPU
    workers), `requested` what the user passed ("auto", "nccl", ...). Only
    an NCCL ring is re-planned: two ranks on one GPU turn `auto` into
    "gloo", and make an explicit "nccl" a `DeviceConflictError`.
    """
    if resolved != "nccl":
        return BackendPlan(resolved)
    shared = shared_gpus(seats)
    if not shared:
        return BackendPlan(resolved)
    (node, gpu), ranks = next(iter(shared.items()))
    who = ", ".join(f"{seats[r].worker_id} (rank {r})" for r in ranks)
    where = f"GPU {gpu} of node {node[:12]}"
    more = f" ({len(shared) - 1} more GPU(s) shared likewise)" if len(shared) > 1 else ""
    if requested == "nccl":
        raise DeviceConflictError(
            f"backend='nccl' cannot run these workers: {who} share {where}{more}, and NCCL allows one rank per "
            "GPU. Ask for whole GPUs (resources_per_worker={'GPU': 1}), or pass backend='auto' or 'gloo' to "
            "train over torch Gloo with the tensors staged through host memory"
        )
    return BackendPlan(
        "gloo",
        f"{who} share {where}{more} and NCCL allows one rank per GPU: this ring runs torch Gloo, its CUDA "
        "tensors staged through host memory (whole GPUs per worker give NCCL)",
    )


def device_index(gpu_ids: Sequence[str], visible: str | None, local_rank: int, count: int) -> int:
    """The CUDA index, in this process, of the first GPU Ray gave the worker.

    `visible` is `CUDA_VISIBLE_DEVICES` (None: unset, every GPU visible by
    its id). Ray narrows it to the worker's GPUs, so that is usually 0.
    With no GPU from Ray (not a Ray GPU worker), the worker's `local_rank`
    among the `count` visible GPUs.
    """
    if count <= 0:
        raise ValueError("this process sees no GPU")
    if gpu_ids:
        first = str(gpu_ids[0])
        if visible is not None:
            listed = [v.strip() for v in visible.split(",") if v.strip()]
            if first in listed and listed.index(first) < count:
                return listed.index(first)
        elif first.isdigit() and int(first) < count:
            return int(first)
    return local_rank % count


def ray_gpu_ids() -> list[str]:
    """The GPU ids Ray gave this worker process (empty outside a Ray GPU worker)."""
    try:
        import ray

        if not ray.is_initialized():
            return []
        return [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # noqa: BLE001 - outside a Ray worker there is no assignment: the fallback decides
        return []


def visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")
