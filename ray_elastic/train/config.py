"""Ray Train's configs read as `ElasticTrainer` options, and what has no elastic counterpart refused by name.

The config classes are Ray's own (`ray.train.ScalingConfig`, `RunConfig`,
`CheckpointConfig`, `FailureConfig`, `BackendConfig`, `DataConfig`,
`ray.train.torch.TorchConfig`), so a script builds them unchanged; the one
addition is `ScalingConfig(spares=K)`, through this package's subclass of
Ray's `ScalingConfig` (`ElasticScalingConfig`, exported as `ScalingConfig`):
hot spares sit beside the world's size, and Ray's own class refuses the
keyword.
`trainer_options` maps them onto the options of the one driver
(`ElasticTrainer`); `split_datasets` reads a `DataConfig`. A field set to
anything but Ray's default that the elastic run cannot honour raises
`ValueError` naming the field, before anything is spawned, rather than being
ignored.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from ray.train import BackendConfig, CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig

from ray_elastic import ray_private

if TYPE_CHECKING:
    from collections.abc import Mapping

# the fields each config may leave only at Ray's default, and why
_REFUSED: dict[type, dict[str, str]] = {
    ScalingConfig: {
        "trainer_resources": "the elastic driver is a small actor of its own, with no resources to set",
        "placement_strategy": "workers are placed one per slot that discovery offers (oldest hosts first)",
        "accelerator_type": "pick the node kind through resources_per_worker (a custom resource)",
        "label_selector": "workers go where discovery finds slots; there is no label scheduling",
        "use_tpu": "TPUs are not supported: the rings are Gloo or NCCL",
        "topology": "TPUs are not supported: the rings are Gloo or NCCL",
        "elastic_resize_monitor_interval_s": "the cluster is watched every second and resized in place",
    },
    RunConfig: {
        "storage_filesystem": "give storage_path as a local path or an fsspec URL",
        "callbacks": "Ray Train callbacks hook its controller, which an elastic run does not have",
        "worker_runtime_env": "set the runtime environment with ray.init(runtime_env=...)",
        "logging_config": "the workers log through Ray's own logging",
    },
    CheckpointConfig: {
        "checkpoint_score_attribute": "the last reported checkpoint is the one kept (no ranking)",
        "checkpoint_score_order": "the last reported checkpoint is the one kept (no ranking)",
    },
    FailureConfig: {
        "controller_failure_limit": "there is no Ray Train controller; the driver actor restarts itself",
        "max_preemption_failures": "a preempted (drained) node's workers leave gracefully and are never counted",
        "relax_collectives_on_preemption": "a drained node's workers leave at the next report with a checkpoint",
        "preemption_grace_s": "a drained node's workers leave at the next report with a checkpoint",
    },
    TorchConfig: {
        "init_method": "the ring is set up by the run's own rendezvous",
    },
}

@dataclasses.dataclass
class ElasticScalingConfig(ScalingConfig):
    """Ray's `ScalingConfig`, plus `spares`: hot spares booted ahead of need (`ElasticTrainer(spares=)`).

    A subclass, so Ray's code and the user's own checks still see a
    `ray.train.ScalingConfig`; `ray_elastic.train.ScalingConfig` is this class.
    """

    spares: int = 0


# trainer keywords that have no elastic counterpart
REFUSED_TRAINER_ARGS: dict[str, str] = {
    "validation_config": "validate in train_loop_per_worker and report the result",
    "metadata": "pass what the workers need in train_loop_config",
}

_UNLIMITED_FAILURES = 2**31 - 1  # Ray's max_failures=-1


def check_unsupported(config: Any) -> None:
    """Raise `ValueError` naming the first field of `config` set away from Ray's default that cannot be honoured."""
    ray_class = next((cls for cls in type(config).__mro__ if cls in _REFUSED), type(config))  # ours: Ray's
    refused = _REFUSED.get(ray_class, {})
    default = type(config)()
    for name, why in refused.items():
        if getattr(config, name) != getattr(default, name):
            raise ValueError(
                f"{ray_class.__name__}({name}={getattr(config, name)!r}) is not supported by "
                f"ray_elastic.train: {why}"
            )


def _typed(value: Any, cls: type, what: str) -> Any:
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{what} must be a ray.train {cls.__name__}, got {type(value).__name__}")
    return value


def trainer_options(
    scaling_config: ScalingConfig | None,
    run_config: RunConfig | None,
    backend_config: BackendConfig | None,
) -> tuple[dict[str, Any], RunConfig]:
    """The `ElasticTrainer` options these configs ask for, and the run config (Ray's defaults filled in).

    `backend_config` is a `TorchConfig` (None: Ray's default one) or Ray's
    plain `BackendConfig` (the ring's default backend: Gloo on CPUs, NCCL on
    GPUs); another framework's config is refused, naming its class.
    """
    scaling = _typed(scaling_config, ScalingConfig, "scaling_config")
    run = _typed(run_config, RunConfig, "run_config")
    backend = _backend(backend_config)
    checkpointing = _typed(run.checkpoint_config, CheckpointConfig, "RunConfig.checkpoint_config")
    failure = _typed(run.failure_config, FailureConfig, "RunConfig.failure_config")
    for config in (scaling, run, checkpointing, failure, backend):
        check_unsupported(config)
    options: dict[str, Any] = {}
    options["min_workers"], options["max_workers"] = _world(scaling.num_workers)
    options["resources_per_worker"] = _resources(scaling.use_gpu, scaling.resources_per_worker)
    options["spares"] = getattr(scaling, "spares", 0)  # Ray's own class has none
    if isinstance(backend, TorchConfig):
        if backend.backend is not None:
            if backend.backend not in ("gloo", "nccl"):
                raise ValueError(f"TorchConfig(backend={backend.backend!r}): the elastic ring is 'gloo' or 'nccl'")
            options["backend"] = backend.backend
        if backend.timeout_s != TorchConfig().timeout_s:
            options["collective_timeout"] = float(backend.timeout_s)
    max_failures = failure.max_failures
    options["max_failures"] = _UNLIMITED_FAILURES if max_failures == -1 else max_failures
    options["checkpoint_dir"] = os.path.join(run.storage_path, run.name, "elastic")
    options["checkpoint_every"] = 1  # every report with a checkpoint is written
    if checkpointing.num_to_keep is not None:
        options["checkpoint_keep"] = checkpointing.num_to_keep
    return options, run


def _backend(config: Any) -> BackendConfig:
    if config is None:
        return TorchConfig()
    if isinstance(config, TorchConfig) or type(config) is BackendConfig:
        return config
    raise ValueError(
        f"backend_config={type(config).__name__}(...) is not supported by ray_elastic.train: the elastic ring is "
        "torch.distributed over Gloo or NCCL; pass ray.train.torch.TorchConfig or ray.train.BackendConfig"
    )


def split_datasets(dataset_config: Any, datasets: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The datasets the run's feed splits over the workers, and those every worker reads whole, per `DataConfig`.

    As Ray's `DataConfig.configure`: `datasets_to_split` ("all", or a list of
    names; other names are left whole, and names not given are ignored), and
    `execution_options` (one `ExecutionOptions`, or one per name) set on a
    copy of each dataset it names. What differs: a split dataset keeps its
    blocks' order (`preserve_order` is always on, so every rank and every
    re-execution of an epoch agree on its rows), and `enable_shard_locality`
    changes nothing (the feed hands each rank rows by position, wherever
    their blocks are). A subclass that overrides `configure()` is refused:
    the elastic run's feed, not `configure()`, assigns the rows.
    """
    config = DataConfig() if dataset_config is None else dataset_config
    if not isinstance(config, DataConfig):
        raise ValueError(f"dataset_config must be a ray.train.DataConfig, got {type(config).__name__}")
    if type(config).configure is not DataConfig.configure:
        raise ValueError(
            f"{type(config).__name__}.configure() is not supported by ray_elastic.train: the datasets are split by "
            "the run's feed, exactly once per epoch through every membership change; use DataConfig("
            "datasets_to_split=..., execution_options=...) or preprocess the datasets before passing them"
        )
    to_split = ray_private.datasets_to_split(config)  # private attributes, no public getters in Ray 2.60
    split, whole = {}, {}
    for name, dataset in datasets.items():
        options = ray_private.execution_options_of(config, name)
        if options is not None:
            # as configure() does (the copy shares the dataset's DataContext, so the dataset gets the options too)
            dataset = type(dataset).copy(dataset)
            dataset.context.execution_options = copy.deepcopy(options)
        if to_split == "all" or name in to_split:
            split[name] = dataset
        else:
            whole[name] = dataset
    return split, whole


def _world(num_workers: Any) -> tuple[int, int]:
    if isinstance(num_workers, bool):
        raise ValueError(f"ScalingConfig(num_workers={num_workers!r}) must be an int or (min, max)")
    if isinstance(num_workers, int):
        return num_workers, num_workers
    if isinstance(num_workers, tuple) and len(num_workers) == 2 and all(type(n) is int for n in num_workers):
        return num_workers
    raise ValueError(f"ScalingConfig(num_workers={num_workers!r}) must be an int or a (min, max) tuple of ints")


def _resources(use_gpu: Any, resources: Mapping[str, float] | None) -> dict[str, float]:
    if not isinstance(use_gpu, bool):
        raise ValueError(f"ScalingConfig(use_gpu={use_gpu!r}): only True or False (no search space)")
    if resources is not None and not isinstance(resources, dict):
        raise ValueError(f"ScalingConfig(resources_per_worker={resources!r}): a dict of resources (no search space)")
    out = dict(resources) if resources is not None else {"CPU": 1.0}
    if use_gpu:
        out.setdefault("GPU", 1.0)
    return out
