"""`TorchTrainer` and `Result`: Ray Train's driver-side names on one `ElasticTrainer` run.

`TorchTrainer(...)` checks every config before anything is spawned (what
cannot be honoured is refused by name, see `config.py`), maps them onto
`ElasticTrainer`'s options, and wraps `train_loop_per_worker` in the
worker-side re-entry loop (`session.PerWorker`). `fit()` runs it and returns
a `Result` with Ray Train's fields.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ray.train import Checkpoint, RunConfig, ScalingConfig

import ray_elastic as elastic
from ray_elastic.train.config import REFUSED_TRAINER_ARGS, trainer_options
from ray_elastic.train.session import PerWorker, read_directory

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray.train.torch import TorchConfig


@dataclass
class Result:
    """What `TorchTrainer.fit()` returns: Ray Train's `Result` fields, and the elastic run's own.

    - `metrics`: rank 0's last report; `metrics_dataframe`: all of them (pandas).
    - `checkpoint`: the last reported checkpoint (a `ray.train.Checkpoint` of
      a plain directory under `path` holding every rank's files), or None;
      `best_checkpoints`: `[(checkpoint, metrics)]` of every durable one kept
      (`CheckpointConfig(num_to_keep=...)`), oldest first, with rank 0's
      metrics of its report (no ranking).
    - `path`: `storage_path/name`; `error`: None (a failed run raises from `fit()`).
    - `return_value`: what rank 0's `train_loop_per_worker` returned.
    - `elastic`: the `ray_elastic.Result` (membership events, resets, every report).
    """

    metrics: dict[str, Any]
    checkpoint: Checkpoint | None
    path: str
    error: BaseException | None = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    return_value: Any = None
    elastic: Any = None

    @property
    def metrics_dataframe(self) -> Any:
        return self.elastic.metrics_dataframe


class TorchTrainer:
    """Ray Train's `TorchTrainer`, elastic in place: survivors of a failure keep their processes.

    The arguments are Ray Train 2.60's; see docs/migrating-from-ray-train.md
    for what each maps to and what is refused.
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
        resume_from_checkpoint: Checkpoint | None = None,
        **unsupported: Any,
    ) -> None:
        for name, value in unsupported.items():
            if name not in REFUSED_TRAINER_ARGS:
                raise TypeError(f"TorchTrainer() got an unexpected keyword argument {name!r}")
            if value is not None:
                raise ValueError(
                    f"TorchTrainer({name}=...) is not supported by ray_elastic.train: {REFUSED_TRAINER_ARGS[name]}"
                )
        if not callable(train_loop_per_worker):
            raise ValueError(f"train_loop_per_worker must be callable, got {type(train_loop_per_worker).__name__}")
        if len(inspect.signature(train_loop_per_worker).parameters) > 1:
            raise ValueError("train_loop_per_worker takes no argument or one (train_loop_config)")
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise ValueError(f"train_loop_config must be a dict, got {type(train_loop_config).__name__}")
        options, self.run_config = trainer_options(scaling_config, run_config, torch_config)
        initial = None
        if resume_from_checkpoint is not None:
            initial = read_directory(resume_from_checkpoint)
        datasets = {k: v() if callable(v) else v for k, v in (datasets or {}).items()}
        keep = self.run_config.checkpoint_config.num_to_keep if self.run_config.checkpoint_config else None
        loop = PerWorker(train_loop_per_worker, train_loop_config, self.run_config.name, initial, self.path, keep)
        self.trainer = elastic.ElasticTrainer(loop, datasets=datasets or None, **options)

    @property
    def path(self) -> str:
        return os.path.join(self.run_config.storage_path, self.run_config.name)

    def fit(self) -> Result:
        """Train until rank 0's loop returns; raises `ray_elastic.TrainingFailedError` otherwise."""
        outcome = self.trainer.fit()
        value, durable = outcome.return_value
        best = [(Checkpoint.from_directory(os.path.join(self.path, name)), metrics) for name, metrics in durable]
        return Result(
            metrics=outcome.metrics,
            checkpoint=best[-1][0] if best else None,
            path=self.path,
            best_checkpoints=best,
            return_value=value,
            elastic=outcome,
        )
