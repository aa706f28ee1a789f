"""`ray_elastic.train`: a Ray Train v2 script runs elastic in place when only its imports change.

    from ray_elastic.train import ScalingConfig, RunConfig, Checkpoint, report, get_checkpoint, get_context
    from ray_elastic.train.torch import TorchTrainer, prepare_model, prepare_data_loader

The configs, `Checkpoint` and the exceptions a script catches are Ray's own
classes (this needs `ray[train]`, Ray Train v2: 2.60's default);
`TrainingFailedError` and `Result` are subclasses of Ray's. `report(metrics,
checkpoint=...)` is the commit point; a lost worker's survivors re-enter
`train_loop_per_worker` in their own processes, where `get_checkpoint()`
returns the last reported checkpoint (see `session.py` and
docs/migrating-from-ray-train.md). Every public name of `ray.train` is here
but two, refused by name (`get_preemption_info`, `PreemptionInfo`); the
table in docs/ray-train.md says how each behaves.
"""

from __future__ import annotations

import os
from typing import Any

from ray.train import (
    TRAIN_DATASET_KEY,
    BackendConfig,
    Checkpoint,
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    RunConfig,
    SyncConfig,
)

try:
    from ray.train import (
        CheckpointConsistencyMode,
        CheckpointUploadMode,
        ControllerError,
        LoggingConfig,
        NCCLHangError,
        PreemptionError,
        ReportedCheckpoint,
        ReportedCheckpointStatus,
        UserCallback,
        ValidationConfig,
        ValidationFn,
        ValidationTaskConfig,
        WorkerGroupError,
    )
except ImportError as e:  # RAY_TRAIN_V2_ENABLED=0: ray.train is Ray Train v1, whose configs differ
    raise ImportError(
        "ray_elastic.train runs Ray Train v2 scripts: unset RAY_TRAIN_V2_ENABLED or set it to 1 (Ray 2.60's default)"
    ) from e

import ray_elastic as elastic
from ray_elastic.train.config import ElasticScalingConfig as ScalingConfig
from ray_elastic.train.report_store import write_index
from ray_elastic.train.session import LoopInterrupt, TrainContext, current_session
from ray_elastic.train.trainer import DataParallelTrainer, Result, TrainingFailedError, whole_dataset


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
    this = current_session("report")
    before = this.state.checkpoint
    this.report(metrics, checkpoint, bool(delete_local_checkpoint_after_upload), checkpoint_dir_name)
    run_path = this.store.run_path
    if this.state.checkpoint is not before and run_path is not None and elastic.rank() == 0:
        write_index(run_path, this.state.durable)  # committed: Result.from_path finds it with its metrics


def get_checkpoint() -> Checkpoint | None:
    """The last reported checkpoint (None before the first), as a local directory; the same after a re-entry.

    After a re-entry it holds every rank's files of that report, gathered
    from the workers that hold them, so `dcp.load` reshards it to the new world.
    """
    return current_session("get_checkpoint").get_checkpoint()


def get_all_reported_checkpoints(
    consistency_mode: CheckpointConsistencyMode = CheckpointConsistencyMode.VALIDATED,
    timeout_s: float | None = None,
) -> list[ReportedCheckpoint]:
    """Every durable checkpoint kept, oldest first, each with rank 0's metrics of its report (status COMMITTED).

    As `Result.best_checkpoints` will list them: directories under
    `Result.path` (`CheckpointConfig(num_to_keep=...)` keeps the newest).
    Every `report()` is done when it returns and there is no validation, so
    neither argument has anything to wait for.
    """
    del consistency_mode, timeout_s
    this = current_session("get_all_reported_checkpoints")
    run_path = this.store.run_path or ""
    return [
        ReportedCheckpoint(
            checkpoint=Checkpoint.from_directory(os.path.join(run_path, name)),
            metrics=dict(metrics),
            status=ReportedCheckpointStatus.COMMITTED,
        )
        for name, metrics in this.state.durable
    ]


def get_context() -> TrainContext:
    """World rank and size, local rank and size, node rank and experiment name of this worker, now."""
    return current_session("get_context").context


def get_dataset_shard(dataset_name: str | None = None) -> Any:
    """This worker's shard of `TorchTrainer(datasets={name: ds})`; each `iter_*` call is one epoch's pass.

    A dataset `DataConfig(datasets_to_split=...)` leaves whole is Ray's own
    `DataIterator` over all of it, on every worker, as in Ray.
    """
    this = current_session("get_dataset_shard")
    if dataset_name is None:
        raise ValueError("get_dataset_shard needs the dataset's name")
    whole = whole_dataset(dataset_name)
    if whole is not None:
        return whole.iterator()
    return this.get_dataset_shard(dataset_name)


# names of ray.train with no elastic counterpart: `from ray_elastic.train import ...` raises ImportError saying why
_REFUSED = {
    "get_preemption_info": "a drained node's workers leave the run gracefully at its next report with a checkpoint "
    "(nothing is lost and nothing is counted): there is no preemption to poll for",
    "PreemptionInfo": "it is what get_preemption_info() returns, which is refused: a drained node's workers leave "
    "the run gracefully at its next report with a checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _REFUSED:  # an ImportError, not an AttributeError: `from ... import` shows its message
        raise ImportError(f"ray.train.{name} is not supported by ray_elastic.train: {_REFUSED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "TRAIN_DATASET_KEY",
    "BackendConfig",
    "Checkpoint",
    "CheckpointConfig",
    "CheckpointConsistencyMode",
    "CheckpointUploadMode",
    "ControllerError",
    "DataConfig",
    "DataParallelTrainer",
    "FailureConfig",
    "LoggingConfig",
    "LoopInterrupt",
    "NCCLHangError",
    "PreemptionError",
    "ReportedCheckpoint",
    "ReportedCheckpointStatus",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "SyncConfig",
    "TrainContext",
    "TrainingFailedError",
    "UserCallback",
    "ValidationConfig",
    "ValidationFn",
    "ValidationTaskConfig",
    "WorkerGroupError",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
]
