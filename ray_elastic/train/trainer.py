"""`DataParallelTrainer`, `TorchTrainer`, `Result`, `TrainingFailedError`: Ray Train's driver-side names on one run.

`DataParallelTrainer(...)` checks every config before anything is spawned
(what cannot be honoured is refused by name, see `config.py`), maps them
onto `ElasticTrainer`'s options, and wraps `train_loop_per_worker` in the
worker-side re-entry loop (`session.PerWorker`); `TorchTrainer` is the same
trainer with a `TorchConfig`, as in Ray. `fit()` runs it and returns a
`Result` (a subclass of Ray's, with the elastic run's own fields added), or
raises `TrainingFailedError` (a subclass of Ray's and of this project's).
The datasets a `DataConfig` leaves whole travel with the loop to every
worker, where `get_dataset_shard` hands out Ray's own `DataIterator` over
them (`whole_dataset`); the others go to the run's feed, which splits them.
"""

from __future__ import annotations

import inspect
import logging
import os
import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd
import pyarrow.fs
import ray.train
from ray.train import BackendConfig, Checkpoint, DataConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig

import ray_elastic as elastic
from ray_elastic.train.config import REFUSED_TRAINER_ARGS, split_datasets, trainer_options
from ray_elastic.train.report_store import INDEX_FILE, parse_index, write_index
from ray_elastic.train.session import PerWorker, read_directory

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)


class TrainingFailedError(elastic.TrainingFailedError, ray.train.TrainingFailedError):
    """What `fit()` raises when the run fails: a `ray.train.TrainingFailedError` and a `ray_elastic` one.

    So Ray Train's `except ray.train.TrainingFailedError` catches it, and so
    does code written for `ElasticTrainer`. The message says why, as the
    elastic run's does; `return_value` is what rank 0's loop returned if it
    did before the run failed, else None. Ray's subclasses of it
    (`WorkerGroupError`, `ControllerError`) are never raised.
    """


@dataclass
class Result(ray.train.Result):
    """What `fit()` returns: a `ray.train.Result` (Ray's fields and methods), with the elastic run's own fields.

    - `metrics`: rank 0's last report; `metrics_dataframe`: every report of
      rank 0, one row each, with a `time` column (Ray Train v2 keeps only the
      reports that carried a checkpoint there).
    - `checkpoint`: the last reported checkpoint (a `ray.train.Checkpoint` of
      a plain directory under `path` holding every rank's files), or None;
      `best_checkpoints`: `[(checkpoint, metrics)]` of every durable one kept
      (`CheckpointConfig(num_to_keep=...)`), oldest first, with rank 0's
      metrics of its report (no ranking).
    - `path`: `storage_path/name`; `filesystem`: the pyarrow filesystem
      `path` is on; `error`: None (a failed run raises from `fit()`).
    - `return_value`: what rank 0's `train_loop_per_worker` returned.
    - `elastic`: the `ray_elastic.Result` (membership events, resets, every report).

    `Result.from_path(path)` reads a run's directory back (see there).
    """

    elastic: Any = field(default=None, repr=False)

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], storage_filesystem: Any = None) -> Result:
        """The `Result` of the run whose `Result.path` is `path`, read from what the run wrote there.

        As Ray Train v2's `Result.from_path`: `checkpoint` and `metrics` are
        the last checkpoint kept and its report's metrics, `best_checkpoints`
        every one kept, `metrics_dataframe` their metrics (one row each, None
        without checkpoints), `error` None. `path` is a local path or a URI
        pyarrow resolves (`s3://...`), or a path on `storage_filesystem`.
        Raises `RuntimeError` if the directory does not exist, or holds no
        `reported_checkpoints.json` (the run reported no checkpoint).
        """
        fs, fs_path = _filesystem_and_path(path, storage_filesystem)
        if fs.get_file_info(fs_path).type == pyarrow.fs.FileType.NotFound:
            raise RuntimeError(f"Experiment folder {fs_path} doesn't exist.")
        index_path = posixpath.join(fs_path, INDEX_FILE)
        if fs.get_file_info(index_path).type == pyarrow.fs.FileType.NotFound:
            raise RuntimeError(
                f"Failed to restore the Result object: {INDEX_FILE} doesn't exist in the experiment folder "
                f"{fs_path}. Make sure that this is the Result.path of a ray_elastic.train run that reported a "
                "checkpoint."
            )
        with fs.open_input_stream(index_path) as f:
            entries = parse_index(f.readall().decode())
        best = []
        for name, metrics in entries:
            where = posixpath.join(fs_path, name)
            if fs.get_file_info(where).type == pyarrow.fs.FileType.Directory:  # pruned after the list was written
                best.append((Checkpoint(where, filesystem=fs), metrics))
        return cls(
            metrics=best[-1][1] if best else None,
            checkpoint=best[-1][0] if best else None,
            error=None,
            path=fs_path,
            metrics_dataframe=pd.DataFrame([m for _, m in best]) if best else None,
            best_checkpoints=best,
            _storage_filesystem=fs,
        )


def _filesystem_and_path(path: str | os.PathLike[str], storage_filesystem: Any) -> tuple[Any, str]:
    location = os.fspath(path)
    if storage_filesystem is not None:
        return storage_filesystem, location.rstrip("/") or "/"
    if "://" in location:
        fs, fs_path = pyarrow.fs.FileSystem.from_uri(location)
        return fs, fs_path.rstrip("/") or "/"
    return pyarrow.fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(location))


# ---- the datasets every worker reads whole ------------------------------------------------------------

_WHOLE: dict[str, Any] = {}  # in a worker process, while its loop runs: the datasets DataConfig left whole


def whole_dataset(name: str) -> Any:
    """The Ray Dataset `name` if every worker reads it whole (`DataConfig(datasets_to_split=...)`), else None."""
    return _WHOLE.get(name)


class _Loop(PerWorker):
    """`PerWorker`, carrying the datasets every worker reads whole into the worker process for the loop's run."""

    def __init__(self, *args: Any, whole: dict[str, Any], names_in_errors: tuple[str, str]) -> None:
        super().__init__(*args)
        self.whole = whole
        self.names_in_errors = names_in_errors

    def __call__(self, _config: dict[str, Any]) -> Any:
        _WHOLE.clear()
        _WHOLE.update(self.whole)
        try:
            return super().__call__(_config)
        finally:
            _WHOLE.clear()


# ---- the trainers ---------------------------------------------------------------------------------------


class DataParallelTrainer:
    """Ray Train's generic `DataParallelTrainer`, elastic in place: survivors of a failure keep their processes.

    Provided rather than refused: Ray's own pages run a plain loop with it
    (`report`, `get_checkpoint`, `get_context`, no framework named), and all
    such a loop calls works here; `TorchTrainer` is this trainer with a
    `TorchConfig`, as in Ray. One difference: where Ray's `BackendConfig()`
    sets nothing up, the workers here always form the elastic ring
    (torch.distributed over Gloo on CPUs, NCCL on GPUs), so the loop may
    also use torch collectives and `prepare_model`. `backend_config` is
    `ray.train.BackendConfig` or `ray.train.torch.TorchConfig`; another
    framework's (`TensorflowConfig`, `JaxConfig`, ...) is refused by name.

    The arguments are Ray Train 2.60's; see docs/ray-train.md for what each
    maps to and what is refused.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[[], Any] | Callable[[dict[str, Any]], Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        backend_config: BackendConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
        metadata: dict[str, Any] | None = None,
        validation_config: Any = None,
    ) -> None:
        me = type(self).__name__
        for name, value in (("validation_config", validation_config), ("metadata", metadata)):
            if value is not None:
                why = REFUSED_TRAINER_ARGS[name]
                raise ValueError(f"{me}({name}=...) is not supported by ray_elastic.train: {why}")
        if not callable(train_loop_per_worker):
            raise ValueError(f"train_loop_per_worker must be callable, got {type(train_loop_per_worker).__name__}")
        if len(inspect.signature(train_loop_per_worker).parameters) > 1:
            raise ValueError("train_loop_per_worker takes no argument or one (train_loop_config)")
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise ValueError(f"train_loop_config must be a dict, got {type(train_loop_config).__name__}")
        options, self.run_config = trainer_options(scaling_config, run_config, backend_config)
        datasets = {k: v() if callable(v) else v for k, v in (datasets or {}).items()}
        split, whole = split_datasets(dataset_config, datasets)
        initial = None
        if resume_from_checkpoint is not None:
            initial = read_directory(resume_from_checkpoint)
        keep = self.run_config.checkpoint_config.num_to_keep if self.run_config.checkpoint_config else None
        loop = _Loop(
            train_loop_per_worker,
            train_loop_config,
            self.run_config.name,
            initial,
            self.path,
            keep,
            whole=whole,
            names_in_errors=("train_loop_per_worker", me),
        )
        # the whole ones go to the feed too, which streams only what a rank asks for: the name checks see them all
        self.trainer = elastic.ElasticTrainer(loop, datasets={**split, **whole} or None, **options)

    @property
    def path(self) -> str:
        return os.path.join(self.run_config.storage_path, self.run_config.name)

    def fit(self) -> Result:
        """Train until rank 0's loop returns; else raise `TrainingFailedError` (a `ray.train.TrainingFailedError`)."""
        try:
            outcome = self.trainer.fit()
        except elastic.TrainingFailedError as e:
            failed = TrainingFailedError(str(e), e.return_value)
            failed.__dict__.update(e.__dict__)
            raise failed from e.__cause__
        value, durable = outcome.return_value
        if durable:
            try:  # the workers wrote it after each report; again here, in case rank 0 died right after its last
                write_index(self.path, durable)
            except OSError as e:
                logger.warning("could not write %s under %s (Result.from_path reads it): %s", INDEX_FILE, self.path, e)
        best = [(Checkpoint.from_directory(os.path.join(self.path, name)), metrics) for name, metrics in durable]
        return Result(
            metrics=outcome.metrics,
            checkpoint=best[-1][0] if best else None,
            error=None,
            path=self.path,
            metrics_dataframe=outcome.metrics_dataframe,
            best_checkpoints=best,
            return_value=value,
            elastic=outcome,
        )


class TorchTrainer(DataParallelTrainer):
    """Ray Train's `TorchTrainer`, elastic in place: a `DataParallelTrainer` with a `TorchConfig`, as in Ray.

    The arguments are Ray Train 2.60's; see docs/ray-train.md for what each
    maps to and what is refused.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[[], Any] | Callable[[dict[str, Any]], Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        torch_config: TorchConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: DataConfig | None = None,
        validation_config: Any = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
    ) -> None:
        if torch_config is not None and not isinstance(torch_config, TorchConfig):
            raise TypeError(f"torch_config must be a ray.train TorchConfig, got {type(torch_config).__name__}")
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=torch_config if torch_config is not None else TorchConfig(),
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            resume_from_checkpoint=resume_from_checkpoint,
            metadata=metadata,
            validation_config=validation_config,
        )
