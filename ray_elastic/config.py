"""The trainer's options, validated once into one frozen `RunConfig`.

`RunConfig.create(...)` checks every option and raises a `ValueError` that
names the option and the bad value, before anything is spawned. The driver
reads the `RunConfig` itself; each worker receives `RunConfig.worker(run_id)`,
the few fields a worker needs (`WorkerConfig`). Nothing copies the options a
second time or patches them later.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray_elastic.checkpoint import CheckpointError, CheckpointStore, normalize_url

BACKENDS = ("auto", "gloo", "pygloo", "nccl")


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs of the run's options."""

    backend: str = "gloo"
    backend_requested: str = "auto"  # what the user passed: "auto" may fall back from NCCL, "nccl" may not
    rendezvous_timeout: float = 600.0  # waiting for a generation (covers elastic_timeout)
    collective_timeout: float = 300.0  # one collective, and forming one ring
    checkpoint_dir: str | None = None  # durable checkpoints (local path or fsspec URL), written by rank 0
    checkpoint_every: int = 10  # commits between two durable checkpoints
    checkpoint_keep: int = 2  # how many of the newest durable checkpoints checkpoint_dir keeps
    run_id: str = ""  # tags this worker's metrics
    datasets: tuple[str, ...] = ()  # the names of the run's Ray Datasets (`get_dataset_shard`)
    cpus: float = 1.0  # the CPUs reserved for each worker: its torch threads (`runtime/threads.py`)
    omp_threads_set: bool = False  # the user set OMP_NUM_THREADS in fit()'s environment: it holds


@dataclass(frozen=True)
class RunConfig:
    """Every option of a run, validated (see `ElasticTrainer` for their meaning)."""

    min_workers: int
    max_workers: int
    resources_per_worker: Mapping[str, float]
    backend: str = "gloo"
    backend_requested: str = "auto"  # the user's `backend` before `resolve_backend`
    elastic_timeout: float = 600.0
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] = (10.0, 300.0)
    discovery_interval: float = 1.0
    discovery_timeout: float = 30.0
    liveness_timeout: float = 5.0
    collective_timeout: float = 300.0
    max_failures: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    checkpoint_keep: int = 2
    keep_metrics: int | None = 100_000
    datasets: tuple[str, ...] = ()  # the names of the run's Ray Datasets (the datasets go to the feed actor)
    data_cpus: int = 1  # whole CPUs the workers leave free for Ray Data's tasks (with datasets= only)
    data_starvation_timeout: float = 60.0  # a pipeline starved of CPUs this long fails the run (data_cpus=0)
    evict_stragglers: bool = True  # let a persistently slow worker go (else only report it)
    # CPUs reserved per worker where the workers' own request does not hold them (a Tune trial's bundles)
    reserved_cpus: float | None = None
    omp_threads_set: bool = False  # OMP_NUM_THREADS was set in fit()'s environment: workers keep it

    @property
    def kept_cpus(self) -> int:
        """The CPUs discovery keeps from the workers: `data_cpus` if the run has datasets, else none."""
        return self.data_cpus if self.datasets else 0

    @classmethod
    def create(
        cls,
        *,
        min_workers: Any,
        max_workers: Any,
        resources_per_worker: Mapping[str, float] | None,
        backend: str,
        elastic_timeout: float,
        reset_limit: int | None,
        cooldown_range: Any,
        discovery_interval: float,
        discovery_timeout: float,
        liveness_timeout: float,
        collective_timeout: float,
        max_failures: int,
        checkpoint_dir: str | os.PathLike | None,
        checkpoint_every: int,
        keep_metrics: int | None,
        checkpoint_keep: int = 2,
        datasets: tuple[str, ...] = (),
        data_cpus: int = 1,
        data_starvation_timeout: float = 60.0,
        evict_stragglers: bool = True,
    ) -> RunConfig:
        """Check every option (`ElasticTrainer`'s signature holds their defaults, once).

        `backend="auto"` is resolved against what this interpreter can import.
        """
        _check_int("min_workers", min_workers, 1)
        _check_int("max_workers", max_workers, 1)
        if max_workers < min_workers:
            raise ValueError(f"max_workers ({max_workers}) must be >= min_workers ({min_workers})")
        resources = _check_resources(resources_per_worker)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for name, value in (
            ("elastic_timeout", elastic_timeout),
            ("discovery_interval", discovery_interval),
            ("discovery_timeout", discovery_timeout),
            ("liveness_timeout", liveness_timeout),
            ("collective_timeout", collective_timeout),
            ("data_starvation_timeout", data_starvation_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if reset_limit is not None:
            _check_int("reset_limit", reset_limit, 0)
        _check_int("max_failures", max_failures, 0)
        _check_int("checkpoint_every", checkpoint_every, 1)
        _check_int("checkpoint_keep", checkpoint_keep, 1)
        _check_int("data_cpus", data_cpus, 0)  # Ray Data's tasks ask for whole CPUs (one each by default)
        if keep_metrics is not None:
            _check_int("keep_metrics", keep_metrics, 0)
        url = None
        if checkpoint_dir is not None:
            if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
                raise ValueError(f"checkpoint_dir must be a path or an fsspec URL, got {checkpoint_dir!r}")
            url = normalize_url(checkpoint_dir)
            try:
                CheckpointStore(url)
            except CheckpointError as e:
                raise ValueError(str(e)) from e
        if (
            not isinstance(cooldown_range, (tuple, list))
            or len(cooldown_range) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in cooldown_range)
            or not 0 <= cooldown_range[0] <= cooldown_range[1]
        ):
            raise ValueError(f"cooldown_range must be (min_s, max_s) with 0 <= min_s <= max_s, got {cooldown_range!r}")
        if not isinstance(evict_stragglers, bool):
            raise ValueError(f"evict_stragglers must be True or False, got {evict_stragglers!r}")
        return cls(
            min_workers=min_workers,
            max_workers=max_workers,
            resources_per_worker=resources,
            backend=resolve_backend(backend, resources),
            backend_requested=backend,
            elastic_timeout=float(elastic_timeout),
            reset_limit=reset_limit,
            cooldown_range=(float(cooldown_range[0]), float(cooldown_range[1])),
            discovery_interval=float(discovery_interval),
            discovery_timeout=float(discovery_timeout),
            liveness_timeout=float(liveness_timeout),
            collective_timeout=float(collective_timeout),
            max_failures=max_failures,
            checkpoint_dir=url,
            checkpoint_every=checkpoint_every,
            checkpoint_keep=checkpoint_keep,
            keep_metrics=keep_metrics,
            datasets=tuple(datasets),
            data_cpus=data_cpus,
            data_starvation_timeout=float(data_starvation_timeout),
            evict_stragglers=evict_stragglers,
            omp_threads_set="OMP_NUM_THREADS" in os.environ,  # fit()'s process: a local Ray's workers inherit it
        )

    def worker(self, run_id: str) -> WorkerConfig:
        """The worker's view: a worker waits for a generation as long as the driver may wait for workers."""
        return WorkerConfig(
            backend=self.backend,
            backend_requested=self.backend_requested,
            rendezvous_timeout=self.elastic_timeout + self.collective_timeout,
            collective_timeout=self.collective_timeout,
            checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.checkpoint_every,
            checkpoint_keep=self.checkpoint_keep,
            run_id=run_id,
            datasets=self.datasets,
            cpus=self.resources_per_worker.get("CPU", 0.0) if self.reserved_cpus is None else self.reserved_cpus,
            omp_threads_set=self.omp_threads_set,
        )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_resources(resources: Mapping[str, float] | None) -> dict[str, float]:
    if resources is None:
        return {"CPU": 1.0}
    if not isinstance(resources, Mapping) or not resources:
        raise ValueError(f"resources_per_worker must be a non-empty dict like {{'CPU': 1}}, got {resources!r}")
    out: dict[str, float] = {}
    for name, amount in resources.items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise ValueError(f"resources_per_worker entries must be name -> number, got {name!r}: {amount!r}")
        if amount < 0 or math.isnan(amount) or math.isinf(amount):
            raise ValueError(f"resources_per_worker[{name!r}] must be a finite number >= 0, got {amount!r}")
        out[name] = float(amount)
    if not any(out.values()):
        raise ValueError("resources_per_worker must ask for some resource (all amounts are 0)")
    if "object_store_memory" in out:
        # Ray refuses it as an actor resource; only a node's start options set the object store's size
        raise ValueError(
            "resources_per_worker cannot ask for 'object_store_memory' (Ray sets the object store per node, "
            "not per actor); use 'memory' for a worker's heap"
        )
    return out


def resolve_backend(backend: str, resources: Mapping[str, float]) -> str:
    """The backend `backend` stands for, checked against what this interpreter can import.

    The workers of a local cluster run in the driver's environment, so a
    library missing here would be missing there: better said now than after
    the workers started.
    """
    has_torch = importlib.util.find_spec("torch") is not None
    has_pygloo = importlib.util.find_spec("pygloo") is not None
    wants_gpu = resources.get("GPU", 0) > 0
    if backend == "auto":
        if wants_gpu:
            backend = "nccl"
        elif has_torch:
            return "gloo"
        elif has_pygloo:
            return "pygloo"
        else:
            raise ValueError(
                "backend='auto' needs torch (pip install torch; the 'torch' extra) or, on Python <= 3.10, "
                "pygloo (pip install pygloo==0.2.1; the 'pygloo' extra)"
            )
    if backend == "nccl" and not wants_gpu:
        raise ValueError(
            f"backend='nccl' runs on GPU workers: ask for one GPU each, e.g. resources_per_worker="
            f"{{'CPU': 1, 'GPU': 1}} (got {dict(resources)})"
        )
    if backend in ("gloo", "nccl") and not has_torch:
        raise ValueError(f"backend={backend!r} needs torch (pip install torch; the 'torch' extra of ray-elastic)")
    if backend == "pygloo" and not has_pygloo:
        raise ValueError(
            "backend='pygloo' needs pygloo, which has wheels for Python <= 3.10 only "
            "(pip install pygloo==0.2.1; the 'pygloo' extra of ray-elastic)"
        )
    return backend
