"""`horovod.torch`'s API on ray-elastic: `import ray_elastic.horovod.torch as hvd`.

A Horovod Elastic script keeps its body: `hvd.init()` at the top,
`hvd.rank()`/`hvd.size()`..., the collectives with Horovod's signatures,
`hvd.DistributedOptimizer`, `hvd.broadcast_parameters`, and
`hvd.elastic.run`/`TorchState`/`ElasticSampler`. It runs in ray-elastic's
worker actors, started by `ray-elastic run SCRIPT.py` (one process per
slot, as `horovodrun` starts them).

`hvd.init()` joins the ring (waiting, bounded, for the generation that
includes this worker) and sets `HOROVOD_RANK`, `HOROVOD_SIZE`,
`HOROVOD_LOCAL_RANK`, `HOROVOD_LOCAL_SIZE`, `HOROVOD_CROSS_RANK`,
`HOROVOD_CROSS_SIZE` and `HOROVOD_HOSTNAME` (the Ray node ID) to this worker's
first place, as Horovod's launcher does. Outside such a worker it raises,
saying how to launch the script.

Horovod names with no counterpart here (`alltoall`, `reducescatter`,
process sets, `SyncBatchNorm`, timelines ...) raise `AttributeError` naming
the name and why; `join()` and the `Adasum`/`Product` ops raise
`NotImplementedError` when used. See docs/migrating-from-horovod.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ray_elastic import (
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    Sum,
    cross_rank,
    cross_size,
    local_rank,
    local_size,
    rank,
    size,
)
from ray_elastic.horovod.torch import elastic
from ray_elastic.horovod.torch.compression import Compression
from ray_elastic.horovod.torch.ops import (
    Adasum,
    Product,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    global_process_set,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    poll,
    synchronize,
)
from ray_elastic.horovod.torch.optimizer import DistributedOptimizer
from ray_elastic.runtime import maybe_current
from ray_elastic.torch import broadcast_optimizer_state as _broadcast_optimizer_state
from ray_elastic.torch import broadcast_parameters as _broadcast_parameters

_NOT_IN_A_WORKER = (
    "hvd.init() works inside a worker started by the launcher: run this script with "
    "`ray-elastic run SCRIPT.py [-np N --min-np N --max-np N ...] -- SCRIPT_ARGS` "
    "(the counterpart of horovodrun), not with python directly"
)


_placed_worker: str | None = None  # the worker whose first place the HOROVOD_* variables hold


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the ring of this worker's generation; a second call does nothing."""
    if comm is not None:
        raise NotImplementedError("hvd.init(comm=...) is not supported: ray-elastic does not use MPI communicators")
    if process_sets is not None:
        raise NotImplementedError("hvd.init(process_sets=...) is not supported: ray-elastic has one process set")
    ctx = maybe_current()
    if ctx is None:
        raise RuntimeError(_NOT_IN_A_WORKER)
    slot = ctx.joined().slot
    start = {
        "HOROVOD_RANK": slot.rank,
        "HOROVOD_SIZE": slot.size,
        "HOROVOD_LOCAL_RANK": slot.local_rank,
        "HOROVOD_LOCAL_SIZE": slot.local_size,
        "HOROVOD_CROSS_RANK": slot.cross_rank,
        "HOROVOD_CROSS_SIZE": slot.cross_size,
        "HOROVOD_HOSTNAME": slot.host,
    }
    global _placed_worker
    if _placed_worker != ctx.worker_id:
        # this worker's first place, as horovodrun sets them at spawn and never again; set, not
        # defaulted: a value the process inherited (a shell that ran under horovodrun, a local
        # cluster started from a process that had them) is another process's place
        os.environ.update({key: str(value) for key, value in start.items()})
        _placed_worker = ctx.worker_id


def shutdown() -> None:
    """Nothing to do: the worker leaves the ring when the script ends (the launcher releases it)."""


def is_initialized() -> bool:
    """Whether this worker has joined a ring (`hvd.init()`, a collective or `@hvd.elastic.run`)."""
    ctx = maybe_current()
    return ctx is not None and ctx.generation_now() is not None


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Copy `root_rank`'s tensors to every rank, in place (`state_dict()`, `named_parameters()`, or tensors)."""
    _broadcast_parameters(params, root_rank)


def broadcast_optimizer_state(optimizer: Any, root_rank: int, model: Any = None) -> None:
    """Copy `root_rank`'s optimizer state and hyper-parameters to every rank (`root_rank` must be 0)."""
    _broadcast_optimizer_state(optimizer, root_rank)


def mpi_threads_supported() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_built() -> bool:
    return False


def gloo_enabled() -> bool:
    """True when the run's collectives go over Gloo (torch's or pygloo)."""
    ctx = maybe_current()
    return ctx is None or ctx.backend in ("gloo", "pygloo")


def gloo_built() -> bool:
    return True


def nccl_built() -> bool:
    """True when torch here can use NCCL (CUDA and torch.distributed's NCCL backend)."""
    return torch.cuda.is_available() and torch.distributed.is_nccl_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return torch.version.hip is not None


# Horovod names with no counterpart here, and why: accessing one raises AttributeError saying so
_UNSUPPORTED = {
    "alltoall": "no alltoall collective",
    "alltoall_async": "no alltoall collective",
    "reducescatter": "no reducescatter collective (use allreduce and keep your slice)",
    "reducescatter_async": "no reducescatter collective (use allreduce and keep your slice)",
    "grouped_reducescatter": "no reducescatter collective (use allreduce and keep your slice)",
    "grouped_reducescatter_async": "no reducescatter collective (use allreduce and keep your slice)",
    "grouped_allgather": "no grouped allgather (call allgather per tensor)",
    "grouped_allgather_async": "no grouped allgather (call allgather per tensor)",
    "sparse_allreduce_async": "no sparse collectives",
    "ProcessSet": "one process set only, all ranks (hvd.global_process_set)",
    "add_process_set": "one process set only, all ranks (hvd.global_process_set)",
    "remove_process_set": "one process set only, all ranks (hvd.global_process_set)",
    "SyncBatchNorm": "no synchronized batch norm",
    "start_timeline": "no Horovod timeline (Result.events and Result.plot_timeline() show the membership)",
    "stop_timeline": "no Horovod timeline (Result.events and Result.plot_timeline() show the membership)",
    "is_homogeneous": "no homogeneity query (hosts may change size at every reset)",
}


def __getattr__(name: str) -> Any:
    reason = _UNSUPPORTED.get(name)
    if reason is not None:
        raise AttributeError(f"hvd.{name} is not supported by ray_elastic.horovod.torch: ray-elastic has {reason}")
    raise AttributeError(f"module 'ray_elastic.horovod.torch' has no attribute {name!r}")


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]
