"""The NCCL backend, for workers with GPUs (`resources_per_worker={"GPU": 1}`).

A `TorchDistGroup` running NCCL on this worker's GPU, rebuilt on every reset
like the Gloo one. The GPU is the one Ray gave the worker (`ray.get_gpu_ids()`
found among the GPUs the process sees: usually `cuda:0`, see
`devices.device_index`), and made the current device so that torch's object
collectives use it too.

CUDA tensors are reduced where they are. numpy arrays and CPU tensors are
accepted and staged through the GPU: copied there, reduced, copied back into
the caller's value, so the library's own bookkeeping (sampler bitmaps,
`ObjectState`) works unchanged; keep large tensors on the GPU to avoid the
copies.

NCCL runs collectives on a CUDA stream and reports errors asynchronously.
`load()` sets `TORCH_NCCL_BLOCKING_WAIT=1` before the first group, so each
collective waits for its result in the calling thread and a timed-out or
failed collective raises (as `HorovodInternalError`) instead of the watchdog
ending the process. A dead peer is noticed within `collective_timeout`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ray_elastic.collective import devices
from ray_elastic.collective.torch_dist import TorchDistGroup, as_tensor

if TYPE_CHECKING:
    from collections.abc import Callable


def load() -> None:
    """Check that this worker can run NCCL, and make its failures raise in the calling thread."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "backend 'nccl' needs a GPU, but this worker sees none "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
            "ask for one with resources_per_worker={'GPU': 1}"
        )
    if not dist.is_nccl_available():
        raise RuntimeError(f"backend 'nccl': this worker's torch {torch.__version__} was built without NCCL")
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")


def device_for(local_rank: int) -> torch.device:
    """The GPU Ray gave this worker, among the GPUs this process sees (by local rank where Ray gave none)."""
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("backend 'nccl' needs a GPU, but this worker sees none")
    return torch.device(
        "cuda", devices.device_index(devices.ray_gpu_ids(), devices.visible_devices(), local_rank, count)
    )


class TorchNcclGroup(TorchDistGroup):
    """A torch.distributed NCCL process group on this worker's GPU for one generation."""

    name = "nccl"
    backend = "nccl"

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: float, local_rank: int) -> None:
        load()
        device = device_for(local_rank)
        torch.cuda.set_device(device)
        super().__init__(store, rank, size, timeout, device)

    def _stage(self, value: Any) -> tuple[torch.Tensor, Callable[[], None] | None]:
        t = as_tensor(value)
        if t.is_cuda:
            return t, None
        on_gpu = t.to(self.device)
        # `t` shares the caller's memory (a numpy array's too), so copying into it writes the result back
        return on_gpu, lambda: t.copy_(on_gpu)
