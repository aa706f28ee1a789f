"""The run's options, checked once into one frozen `RunConfig`.

Every option is declared in `options.py`'s table (its concern, default,
check and meaning); `RunConfig`'s fields take their defaults from it.
`RunConfig.create(...)` checks every option and raises a `ValueError` that
names the option and the bad value, before anything is spawned;
`RunConfig.replace(...)` changes options through the same checks. The
driver reads the `RunConfig` itself; each worker receives
`RunConfig.worker(run_id)`, the few fields a worker needs (`WorkerConfig`, a
protocol type). Nothing copies the options a second time or patches them
later.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_elastic.options import BY_NAME, DEFAULTS, check_all
from ray_elastic.protocol import WorkerConfig

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["RunConfig", "resolve_backend"]

_D = DEFAULTS


@dataclass(frozen=True)
class RunConfig:
    """Every option of a run, checked (`options.OPTIONS` says what each means), and what was derived from them."""

    min_workers: int
    max_workers: int
    resources_per_worker: Mapping[str, float]
    # scaling
    backend: str = "gloo"  # the backend `backend="auto"` resolved to
    discovery_interval: float = _D["discovery_interval"]
    evict_stragglers: bool = _D["evict_stragglers"]
    spares: int = _D["spares"]
    # failure
    reset_limit: int | None = _D["reset_limit"]
    cooldown_range: tuple[float, float] = _D["cooldown_range"]
    max_failures: int = _D["max_failures"]
    # timeouts
    elastic_timeout: float = _D["elastic_timeout"]
    discovery_timeout: float = _D["discovery_timeout"]
    liveness_timeout: float = _D["liveness_timeout"]
    collective_timeout: float = _D["collective_timeout"]
    checkpoint_timeout: float | None = _D["checkpoint_timeout"]  # None: collective_timeout
    # checkpoint
    checkpoint_dir: str | None = _D["checkpoint_dir"]
    checkpoint_every: int = _D["checkpoint_every"]
    checkpoint_keep: int = _D["checkpoint_keep"]
    # data
    datasets: tuple[str, ...] = _D["datasets"]  # the names of the run's Ray Datasets (they go to the feed actor)
    data_cpus: int = _D["data_cpus"]
    data_starvation_timeout: float = _D["data_starvation_timeout"]
    # results
    keep_metrics: int | None = _D["keep_metrics"]
    # derived, not options
    backend_requested: str = "auto"  # the user's `backend` before `resolve_backend`
    # CPUs reserved per worker where the workers' own request does not hold them (a Tune trial's bundles)
    reserved_cpus: float | None = None
    omp_threads_set: bool = False  # OMP_NUM_THREADS was set in fit()'s environment: workers keep it

    @property
    def kept_cpus(self) -> int:
        """The CPUs discovery keeps from the workers: `data_cpus` if the run has datasets, else none."""
        return self.data_cpus if self.datasets else 0

    @property
    def checkpoint_io_timeout(self) -> float:
        """The bound of one durable checkpoint write or read: `checkpoint_timeout`, else `collective_timeout`."""
        return self.collective_timeout if self.checkpoint_timeout is None else self.checkpoint_timeout

    @classmethod
    def create(cls, **options: Any) -> RunConfig:
        """Check every option (`options.OPTIONS` holds their defaults, once); a `ValueError` names a bad one.

        `backend="auto"` is resolved against what this interpreter can import.
        """
        values = check_all(options)
        if values["max_workers"] < values["min_workers"]:
            raise ValueError(
                f"max_workers ({values['max_workers']}) must be >= min_workers ({values['min_workers']})"
            )
        requested = values["backend"]
        return cls(
            **{**values, "backend": resolve_backend(requested, values["resources_per_worker"])},
            backend_requested=requested,
            omp_threads_set="OMP_NUM_THREADS" in os.environ,  # fit()'s process: a local Ray's workers inherit it
        )

    def replace(self, *, reserved_cpus: float | None = None, **options: Any) -> RunConfig:
        """This config with some options changed, each checked as `create` checks it.

        `reserved_cpus` (not an option: a Tune trial's bundles hold the
        workers' CPUs) is checked here too.
        """
        given = {o: getattr(self, o) for o in BY_NAME}
        given["backend"] = self.backend_requested
        given.update(options)
        changed = RunConfig.create(**given)
        if reserved_cpus is not None and (
            isinstance(reserved_cpus, bool) or not isinstance(reserved_cpus, (int, float)) or reserved_cpus < 0
        ):
            raise ValueError(f"reserved_cpus must be a number >= 0, got {reserved_cpus!r}")
        return dataclasses.replace(
            changed,
            reserved_cpus=self.reserved_cpus if reserved_cpus is None else float(reserved_cpus),
            omp_threads_set=self.omp_threads_set,
        )

    def worker(self, run_id: str) -> WorkerConfig:
        """The worker's view: a worker waits for a generation as long as the driver may wait for workers."""
        return WorkerConfig(
            backend=self.backend,
            backend_requested=self.backend_requested,
            rendezvous_timeout=self.elastic_timeout + self.collective_timeout,
            collective_timeout=self.collective_timeout,
            checkpoint_timeout=self.checkpoint_io_timeout,
            checkpoint_dir=self.checkpoint_dir,
            checkpoint_every=self.checkpoint_every,
            checkpoint_keep=self.checkpoint_keep,
            run_id=run_id,
            datasets=self.datasets,
            cpus=self.resources_per_worker.get("CPU", 0.0) if self.reserved_cpus is None else self.reserved_cpus,
            omp_threads_set=self.omp_threads_set,
        )


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
