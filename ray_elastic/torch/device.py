"""`get_device()`: the device a worker trains on, as Ray Train names it.

The worker's GPU when Ray gave it one (the first of its GPU ids, found among
the GPUs this process sees; see `collective/devices.device_index`), else
the CPU. Outside a Ray GPU actor with GPUs visible, the local rank picks
one, as torch's launchers do. The GPU is made the current CUDA device, so
tensors created with `device="cuda"` land on it too.
"""

from __future__ import annotations

import torch

from ray_elastic.collective.devices import device_index, ray_gpu_ids, visible_devices
from ray_elastic.runtime.process import maybe_current


def get_device() -> torch.device:
    """This worker's device: its GPU (`cuda:N`) when it has one, else `cpu`."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return torch.device("cpu")
    ctx = maybe_current()
    slot = getattr(ctx, "slot", None) if ctx is not None else None
    gpu_ids = ray_gpu_ids()
    if ctx is not None and not gpu_ids:
        return torch.device("cpu")  # a Ray worker without a GPU of its own: the GPUs it sees are not its own
    local_rank = slot.local_rank if slot is not None else 0
    device = torch.device("cuda", device_index(gpu_ids, visible_devices(), local_rank, torch.cuda.device_count()))
    torch.cuda.set_device(device)
    return device
