"""ray-elastic: elastic, fault-tolerant data-parallel training on Ray.

Horovod Elastic's semantics (`State.commit()`, `check_host_updates()`,
`HostsUpdatedInterrupt`, `HorovodInternalError`, reset callbacks) on Ray's
machinery. On the driver side: `ElasticTrainer(train_fn, ...).fit()`. Inside
`train_fn`: `rank()`, `size()`, the collectives, `report()`, `State`,
`ObjectState` and `@run`. PyTorch helpers live in `ray_elastic.torch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_elastic.checkpoint import load_checkpoint
from ray_elastic.collective import Average, CollectiveMismatchError, Max, Min, ReduceOp, Sum, set_argument_checks
from ray_elastic.elastic import run
from ray_elastic.events import Event
from ray_elastic.exceptions import (
    CheckpointError,
    DataStarvedError,
    DeviceConflictError,
    DiscoveryError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RendezvousTimeoutError,
    StateRegressionError,
    TrainingFailedError,
)
from ray_elastic.runtime.process import current, maybe_current
from ray_elastic.runtime.ring_ops import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
)
from ray_elastic.state import ObjectState, State

if TYPE_CHECKING:
    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.trainer import ElasticTrainer, Result

__version__ = "0.1.0"


def _slot() -> WorkerSlot:
    return current().joined().slot


def rank() -> int:
    """This worker's rank in the current generation (0 is the oldest survivor)."""
    return _slot().rank


def size() -> int:
    """The number of workers in the current generation."""
    return _slot().size


def local_rank() -> int:
    """This worker's index among the workers on its host."""
    return _slot().local_rank


def local_size() -> int:
    """The number of workers on this worker's host."""
    return _slot().local_size


def cross_rank() -> int:
    """The index of this worker's host among hosts with a worker at this local rank."""
    return _slot().cross_rank


def cross_size() -> int:
    """The number of hosts with a worker at this local rank."""
    return _slot().cross_size


def get_dataset_shard(name: str, *, shuffle: bool = False, seed: int = 0) -> Any:
    """This worker's `DataShard` of the dataset given as `ElasticTrainer(..., datasets={name: ds})`."""
    from ray_elastic.data import get_dataset_shard as get

    return get(name, shuffle=shuffle, seed=seed)


def report(metrics: dict[str, Any]) -> None:
    """Record metrics (kept from rank 0). Never blocks: they are shipped in the background."""
    ctx = maybe_current()
    if ctx is None:
        raise RuntimeError("report() only works inside train_fn running under ElasticTrainer.fit()")
    ctx.report(metrics)


def __getattr__(name: str) -> Any:
    if name == "torch":  # imported on first use, so numpy-only users never load torch
        import importlib

        return importlib.import_module("ray_elastic.torch")
    if name in ("ElasticTrainer", "Result"):
        # the user's side, loaded on first use: a worker imports this package to run train_fn, and the trainer
        # would bring the driver's teardown and Ray's autoscaler SDK into every newcomer's boot (bench/boot_phases.py)
        from ray_elastic import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'ray_elastic' has no attribute {name!r}")


__all__ = [
    "Average",
    "CheckpointError",
    "DataStarvedError",
    "DeviceConflictError",
    "DiscoveryError",
    "CollectiveMismatchError",
    "ElasticTrainer",
    "get_dataset_shard",
    "Event",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ObjectState",
    "ReduceOp",
    "RendezvousTimeoutError",
    "Result",
    "State",
    "StateRegressionError",
    "Sum",
    "TrainingFailedError",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "cross_rank",
    "cross_size",
    "local_rank",
    "local_size",
    "rank",
    "load_checkpoint",
    "report",
    "run",
    "set_argument_checks",
    "size",
]
