"""`ray_elastic.train`: a Ray Train v2 script runs elastic in place when only its imports change.

    from ray_elastic.train import ScalingConfig, RunConfig, Checkpoint, report, get_checkpoint, get_context
    from ray_elastic.train.torch import TorchTrainer, prepare_model, prepare_data_loader

The configs and `Checkpoint` are Ray's own classes (this needs `ray[train]`,
whose pandas and pyarrow come with `ray[data]`). `report(metrics,
checkpoint=...)` is the commit point; a lost worker's survivors re-enter
`train_loop_per_worker` in their own processes, where `get_checkpoint()`
returns the last reported checkpoint (see `session.py` and
docs/migrating-from-ray-train.md).
"""

from __future__ import annotations

from typing import Any

from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

from ray_elastic.train.session import LoopInterrupt, TrainContext, current_session


def report(
    metrics: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: Any = None,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Any = None,
    validation: Any = False,
) -> None:
    """Report `metrics` (rank 0's are kept); with a checkpoint on any rank, commit the run there.

    Call it on every rank at the same step, as Ray Train requires. The
    checkpoint's files are copied into memory at the call (the directory may
    be deleted right after); `delete_local_checkpoint_after_upload=True`
    deletes it here. `checkpoint_dir_name` and `checkpoint_upload_mode` change
    nothing (the copy is in memory and synchronous); `checkpoint_upload_fn`
    and `validation` are refused.
    """
    del checkpoint_dir_name, checkpoint_upload_mode
    if checkpoint_upload_fn is not None:
        raise ValueError("report(checkpoint_upload_fn=...) is not supported by ray_elastic.train")
    if validation:
        raise ValueError("report(validation=...) is not supported by ray_elastic.train: validate in the loop")
    current_session("report").report(metrics, checkpoint, bool(delete_local_checkpoint_after_upload))


def get_checkpoint() -> Checkpoint | None:
    """The last reported checkpoint (None before the first), as a local directory; the same after a re-entry."""
    return current_session("get_checkpoint").get_checkpoint()


def get_context() -> TrainContext:
    """World rank and size, local rank and size, node rank and experiment name of this worker, now."""
    return current_session("get_context").context


def get_dataset_shard(dataset_name: str | None = None) -> Any:
    """This worker's shard of `TorchTrainer(datasets={name: ds})`; each `iter_*` call is one epoch's pass."""
    this = current_session("get_dataset_shard")
    if dataset_name is None:
        raise ValueError("get_dataset_shard needs the dataset's name")
    return this.get_dataset_shard(dataset_name)


__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "FailureConfig",
    "LoopInterrupt",
    "RunConfig",
    "ScalingConfig",
    "TrainContext",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
]
