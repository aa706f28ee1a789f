"""The words the trainer, the driver and the workers exchange, as types.

Everything that crosses an actor boundary or names a kind of thing is defined
here once, so no module compares loose strings with another's:

- `EventKind`: the kinds of membership event in `Result.events`;
- `DriverState`: where the driver's run is (waiting, running, ...);
- `WorkerOutcome`: how a worker's `run()` ended (`Finished`, `Removed`,
  `CoordinatorLost`, `UserError`);
- `RunOutcome` and `DriverStatus`: what the driver hands the trainer at the
  end and while it follows the run;
- `WorkerConfig`: the run's options a worker is started with;
- `PaceSummary`: one rank's pace over an interval, which the workers ship and
  the driver's straggler watch reads.

The enums are `str` enums: a user comparing `event.kind == "worker_failed"`
keeps working, and they print as their value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class _StrEnum(str, enum.Enum):
    """A str enum that prints and formats as its value on every Python we support (3.10+)."""

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]  # str's, on purpose: an f-string shows the value


class EventKind(_StrEnum):
    START = "start"  # generation 1 formed
    WORKER_FAILED = "worker_failed"  # a member died (process, actor or node), was killed as hung, or its ring broke
    NEWCOMER_FAILED = "newcomer_failed"  # a worker died before it was admitted: no reset
    HOSTS_ADDED = "hosts_added"  # newcomers admitted after booting
    HOSTS_REMOVED = "hosts_removed"  # discovery withdrew hosts: their workers left gracefully
    PREEMPTED = "preempted"  # a node was drained (a preemption notice): its workers left gracefully
    RESET_REQUESTED = "reset_requested"  # a ring broke with every member alive: re-formed
    RESTARTED = "restarted"  # every member was lost: fresh workers resume from the durable checkpoint
    RESUMED = "resumed"  # rank 0 loaded the durable checkpoint
    KV_RESTARTED = "kv_restarted"  # the rendezvous (KV) actor died and Ray restarted it: the generation was restored
    DRIVER_RESTARTED = "driver_restarted"  # the driver actor died and Ray restarted it: it resumed from its snapshot
    BACKEND_CHANGED = "backend_changed"  # ranks share a GPU: their ring runs Gloo with host staging, not NCCL
    DATA_SLOW = "data_slow"  # a dataset's block took as long as data_starvation_timeout, its pipeline running
    SNAPSHOT_REFUSED = "snapshot_refused"  # a restarted driver found an older snapshot than the run's: the run fails
    STRAGGLER_EVICTED = "straggler_evicted"  # a persistently slow worker left gracefully; its host cools down
    STRAGGLER_FOUND = "straggler_found"  # a persistently slow worker kept (eviction off, no gain, min_workers)
    SPARE_PROMOTED = "spare_promoted"  # a hot spare took a place in the next generation (`spares=`)


class DriverState(_StrEnum):
    WAITING = "waiting"  # fewer than min_workers ready
    RUNNING = "running"  # a generation trains
    RESETTING = "resetting"  # a new generation is published and some of its ranks still sync
    DONE = "done"
    FAILED = "failed"

    @property
    def is_final(self) -> bool:
        return self in (DriverState.DONE, DriverState.FAILED)


# ---- how a worker's run() ends (never by raising, for the expected endings) ----
@dataclass(frozen=True)
class Finished:
    """`train_fn` returned; rank 0 ships its value, pickled (`fit()` unpickles it)."""

    rank: int | None
    value: Any = None
    checkpoint_error: str | None = None  # rank 0's last durable checkpoint could not be written: why
    generation: int | None = None  # the generation whose ring the worker trained in last (None: not said)


@dataclass(frozen=True)
class Removed:
    """Left out of a new generation: exited cleanly at its next check."""


@dataclass(frozen=True)
class CoordinatorLost:
    """The run's KV or driver actor is gone: the worker cannot go on."""

    error: str


@dataclass(frozen=True)
class UserError:
    """`train_fn` raised: the user's exception with its traceback.

    `retryable` is False for a mistake that running again would repeat (an
    unpicklable return value, a `train_fn` that never joined the ring):
    `max_failures` does not retry it.
    """

    error: str
    traceback: str
    retryable: bool = True


WorkerOutcome = Finished | Removed | CoordinatorLost | UserError


@dataclass
class DriverStatus:
    """A snapshot for the trainer's progress display."""

    state: DriverState
    generation: int
    world_size: int
    resets: int
    metrics: list[tuple[float, dict[str, Any]]]  # the reports from run-wide index `metrics_from` on
    metrics_from: int
    num_metrics: int
    events: list[dict[str, Any]]  # those the caller has not seen (`status(events_since=)`)
    events_from: int = 0  # the run-wide number of events[0]
    spares: int = 0  # hot spares booted and waiting for a place (`spares=`)


@dataclass
class RunOutcome:
    """How the run ended, as the driver hands it to `fit()`."""

    ok: bool
    error: str | None = None
    value: Any = None
    metrics: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # not yet fetched by fit()
    metrics_from: int = 0  # the run-wide index of metrics[0]
    events: list[dict[str, Any]] = field(default_factory=list)
    resets: int = 0
    checkpoint_error: str | None = None  # why the last durable checkpoint was not written, if it was not
    spares_promoted: int = 0  # hot spares that took a place in a generation


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker needs of the run's options (`RunConfig.worker` makes it; see `options.py`)."""

    backend: str = "gloo"
    backend_requested: str = "auto"  # what the user passed: "auto" may fall back from NCCL, "nccl" may not
    rendezvous_timeout: float = 600.0  # waiting for a generation (covers elastic_timeout)
    collective_timeout: float = 300.0  # one collective, and forming one ring
    checkpoint_timeout: float = 300.0  # one durable checkpoint write, the final flush, a resume's read
    checkpoint_dir: str | None = None  # durable checkpoints (local path or fsspec URL), written by rank 0
    checkpoint_every: int = 10  # commits between two durable checkpoints
    checkpoint_keep: int = 2  # how many of the newest durable checkpoints checkpoint_dir keeps
    run_id: str = ""  # tags this worker's metrics
    datasets: tuple[str, ...] = ()  # the names of the run's Ray Datasets (`get_dataset_shard`)
    cpus: float = 1.0  # the CPUs reserved for each worker: its torch threads (`runtime/threads.py`)
    omp_threads_set: bool = False  # the user set OMP_NUM_THREADS in fit()'s environment: it holds
    spare: bool = False  # started as a hot spare: it waits to be admitted with no deadline of its own


PACE_INTERVAL_S = 1.5
"""The span of one summary. Long enough that a step of ~1 s still counts once or twice in most intervals, short
enough that the driver's window of several intervals (`driver/core/stragglers.py`) fills within tens of seconds."""


@dataclass(frozen=True)
class PaceSummary:
    """One rank's pace over one interval of one generation.

    `start` and `end` are wall-clock seconds; `compute_s` and `wait_s` the
    sums over the interval's `steps` completed steps; `typical_s` the median
    step's compute (None: not measured), which tells a rank slow at every
    step from one doing extra work every N steps; `aside_s` the framework's
    own work this rank did in the interval, left out of `compute_s`.
    """

    generation: int
    start: float
    end: float
    steps: int
    compute_s: float
    wait_s: float
    typical_s: float | None = None
    aside_s: float = 0.0

    @property
    def compute_per_step(self) -> float:
        return self.compute_s / self.steps

    @property
    def wait_per_step(self) -> float:
        return self.wait_s / self.steps
