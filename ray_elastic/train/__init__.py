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

    Call it on every rank at the same step, as Ray Train requires. Every
    rank's checkpoint files are copied into memory at the call (the
    directories may be deleted right after) and combine into one checkpoint,
    as Ray Train's one storage directory does (a path passed by several ranks
    is kept once, from the lowest rank; differing contents are warned about):
    a checkpoint passed by one rank is held by every rank, files passed by
    several ranks (FSDP2's `dcp.save`) by their rank and one replica holder.
    It is also written, synchronously, to `Result.path/checkpoint_dir_name`
    (default `checkpoint_<index>`), a directory that appears only once every
    rank's files are in it. `delete_local_checkpoint_after_upload=True`
    deletes the local directory here; `checkpoint_upload_mode` changes
    nothing; `checkpoint_upload_fn` and `validation` are refused.
    """
    del checkpoint_upload_mode
    if checkpoint_upload_fn is not None:
        raise ValueError("report(checkpoint_upload_fn=...) is not supported by ray_elastic.train")
    if validation:
        raise ValueError("report(validation=...) is not supported by ray_elastic.train: validate in the loop")
    if checkpoint_dir_name is not None and (
        not isinstance(checkpoint_dir_name, str) or checkpoint_dir_name in ("", ".", "..") or "/" in checkpoint_dir_name
    ):
        raise ValueError(f"report(checkpoint_dir_name={checkpoint_dir_name!r}): one directory name under Result.path")
    current_session("report").report(
        metrics, checkpoint, bool(delete_local_checkpoint_after_upload), checkpoint_dir_name
    )


def get_checkpoint() -> Checkpoint | None:
    """The last reported checkpoint (None before the first), as a local directory; the same after a re-entry.

    After a re-entry it holds every rank's files of that report, gathered
    from the workers that hold them, so `dcp.load` reshards it to the new world.
    """
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
