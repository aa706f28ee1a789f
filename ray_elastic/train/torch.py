"""`ray_elastic.train.torch`: Ray Train's `ray.train.torch` names on an elastic run.

`TorchTrainer` and `TorchConfig` (Ray's own class) on the driver side;
`prepare_model`, `prepare_data_loader`, `get_device` and `get_devices`
inside `train_loop_per_worker`. A prepared loader's position is committed
with every report that carries a checkpoint, so a re-entered loop trains
each sample of an epoch exactly once. `TorchCheckpoint` and
`enable_reproducibility` are Ray's own; so are `accelerate`,
`prepare_optimizer` and `backward`, which Ray Train v2 refuses with a
`DeprecationWarning`, as they do here.
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from ray.train.torch import (
    TorchCheckpoint,
    TorchConfig,
    accelerate,
    backward,
    enable_reproducibility,
    prepare_optimizer,
)

import ray_elastic.torch as elastic_torch
from ray_elastic.train.session import current_session
from ray_elastic.train.trainer import Result, TorchTrainer


def get_device() -> torch.device:
    """This worker's device: its GPU when Ray gave it one, else the CPU."""
    return elastic_torch.get_device()


def get_devices() -> list[torch.device]:
    """`[get_device()]`: each worker trains on one device. A worker given several GPUs is refused (Ray lists them)."""
    gpus = ray.get_gpu_ids() if ray.is_initialized() else []
    if len(gpus) > 1:
        raise ValueError(
            f"get_devices(): this worker holds {len(gpus)} GPUs, and ray_elastic.train runs one rank per device: "
            "give each worker one GPU (ScalingConfig(use_gpu=True) without a larger resources_per_worker['GPU'])"
        )
    return [get_device()]


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """The model on this worker's device, in DDP over the elastic ring, with rank 0's parameters and buffers.

    `parallel_strategy="fsdp"` shards it with FSDP2 (`fully_shard` per block,
    then the root; `parallel_strategy_kwargs`: `mp_policy`,
    `reshard_after_forward`, `offload_policy`), where Ray Train wraps it in
    FSDP1. `parallel_strategy=None` moves the model and wraps nothing.
    """
    current_session("prepare_model")
    if parallel_strategy not in ("ddp", "fsdp", None):
        raise ValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}) is not supported by ray_elastic.train: "
            "'ddp', 'fsdp' or None"
        )
    if isinstance(move_to_device, torch.device):
        model.to(move_to_device)
    elif move_to_device:
        model.to(get_device())
    # the state the run loop synced is the checkpoint, not this model: give every rank rank 0's start, as DDP does
    elastic_torch.broadcast_parameters(model.state_dict(), root_rank=0)
    if parallel_strategy is None:
        return model
    return elastic_torch.prepare_model(
        model,
        move_to_device=False,
        parallel_strategy=parallel_strategy,
        parallel_strategy_kwargs=parallel_strategy_kwargs,
    )


def prepare_data_loader(
    data_loader: torch.utils.data.DataLoader,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
) -> Any:
    """The loader sharded over the elastic world, its position committed with each report's checkpoint.

    A pass the loop runs to its end leaves the next one whole (an evaluation
    loader every epoch, without `set_epoch`). `add_dist_sampler=False` keeps
    the loader as it is (every rank reads all of it; no position kept).
    """
    del auto_transfer  # batches are moved as they are handed out
    this = current_session("prepare_data_loader")
    if not add_dist_sampler:
        return data_loader
    return this.prepare_data_loader(data_loader, move_to_device)


__all__ = [
    "Result",
    "TorchCheckpoint",
    "TorchConfig",
    "TorchTrainer",
    "accelerate",
    "backward",
    "enable_reproducibility",
    "get_device",
    "get_devices",
    "prepare_data_loader",
    "prepare_model",
    "prepare_optimizer",
]
