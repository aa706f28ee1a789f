"""What reaches the driver's core (messages) and what it asks its shell to do (actions).

The core is pure: each message carries the facts it needs (the shell looks
them up first, under a deadline, e.g. whether a dead worker's node is still
alive), and each decision comes back as an action value. Times are the
shell's `time.monotonic()`; the core turns them into wall-clock times for
events with the offset it was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

# what the run's actors tell the driver (`DriverActor.tell`) is declared in ray_elastic/wire.py, with the traits
# every message declares (`Fact`); they are the core's messages too, named here with the shell's own
from ray_elastic.wire import (
    BackendNote,
    DataSlow,
    Fact,
    ResetRequested,
    TrainFnRaised,
    WorkerReady,
    WorkerResumed,
    WorkerSynced,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.protocol import PaceSummary, WorkerOutcome


# ---- messages in ---------------------------------------------------------


@dataclass(frozen=True)
class HostsDiscovered(Fact):
    changes_plan: ClassVar[bool] = False  # only when the hosts differ (Scaling.update_hosts)
    quiet: ClassVar[bool] = True  # unless it offers other hosts than the last poll (DurableChanges)

    hosts: Mapping[str, int]


@dataclass(frozen=True)
class NodesDraining(Fact):
    """Ray's draining nodes (`ray drain-node`, a cloud's preemption notice) and their deadlines.

    `deadlines` maps a node ID to the wall-clock time (s) it will be killed, or 0 for none.
    """

    deadlines: Mapping[str, float]


@dataclass(frozen=True)
class DiscoveryFailed(Fact):
    reason: str


@dataclass(frozen=True)
class WorkerExited(Fact):
    """A worker's `run()` returned."""

    worker_id: str
    outcome: WorkerOutcome


@dataclass(frozen=True)
class WorkerDied(Fact):
    """A worker's `run()` failed (actor died, node lost, placement failed)."""

    worker_id: str
    reason: str
    node_alive: bool  # False: its node is gone too, so no cool-down (the node is not coming back as it was)


@dataclass(frozen=True)
class WorkerStartFailed(Fact):
    """Ray refused to start a worker (its options): deterministic, so retrying cannot help."""

    worker_id: str
    reason: str


ACTIVITY_TIMEOUT = "timeout"  # no answer: none in time, or the query failed without a death (`replies.py`)
ACTIVITY_ERROR = "error"  # the member is dead (ActorDiedError): its death message follows


@dataclass(frozen=True)
class ActivityReport(Fact):
    """The members' answers to `QueryActivity`: `{"idle_s", "in_collective"}`, or one of the two markers."""

    generation: int
    worker_id: str
    reason: str
    activity: Mapping[str, Mapping[str, Any] | str]


@dataclass(frozen=True)
class CpuSample:
    """A worker process's CPU use over a short window, read from /proc on its node (`shell/cpu_probe.py`)."""

    busiest_thread_s: float  # CPU seconds its busiest thread used in the window
    window_s: float
    state: str  # the process's state letter at the end: R running, S sleeping, D waiting on I/O, T stopped


@dataclass(frozen=True)
class PingResults(Fact):
    """One liveness round: who answered, who did not answer within `liveness_timeout`.

    `sent_at` is when the pings went out; `samples` holds, for each worker
    that did not answer, its CPU use read on its node, or why no reading
    came back within `liveness_timeout` (a node cut off, a process gone).
    """

    changes_plan: ClassVar[bool] = False
    quiet: ClassVar[bool] = True  # unless a member missed it, or answers again (DurableChanges)

    answered: frozenset[str]
    timed_out: frozenset[str]
    sent_at: float
    samples: Mapping[str, CpuSample | str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointFound(Fact):
    """Whether the durable checkpoint exists; `error`: the storage could not be asked (until elastic_timeout)."""

    exists: bool
    error: str | None = None


@dataclass(frozen=True)
class PublishFailed(Fact):
    generation: int
    reason: str


@dataclass(frozen=True)
class KVLost(Fact):
    reason: str


@dataclass(frozen=True)
class KVRestarted(Fact):
    """The KV actor died and Ray restarted it, empty: it must learn the current generation again."""

    reason: str


@dataclass(frozen=True)
class PacesReported(Fact):
    """A rank's pace summaries (compute and wait per step, per interval), shipped with its metrics."""

    changes_plan: ClassVar[bool] = False
    quiet: ClassVar[bool] = True

    worker_id: str
    paces: tuple[PaceSummary, ...]


@dataclass(frozen=True)
class Tick(Fact):
    """Periodic: deadlines, cool-downs ending."""

    changes_plan: ClassVar[bool] = False
    quiet: ClassVar[bool] = True


@dataclass(frozen=True)
class Stop(Fact):
    reason: str


@dataclass(frozen=True)
class DriverFailed(Fact):
    """The shell's own error ends the run (a snapshot the GCS did not take, a restart that could not resume)."""

    reason: str


@dataclass(frozen=True)
class SnapshotRefused(Fact):
    """A restarted driver refused its snapshot (older than the run's): an event says why, and the run fails."""

    why: str


Message = (
    HostsDiscovered
    | NodesDraining
    | DiscoveryFailed
    | WorkerReady
    | WorkerExited
    | WorkerDied
    | WorkerStartFailed
    | WorkerSynced
    | WorkerResumed
    | ResetRequested
    | TrainFnRaised
    | ActivityReport
    | PingResults
    | CheckpointFound
    | PublishFailed
    | KVLost
    | KVRestarted
    | PacesReported
    | DataSlow
    | BackendNote
    | Tick
    | Stop
    | DriverFailed
    | SnapshotRefused
)


# ---- actions out -----------------------------------------------------------
class Spawn(NamedTuple):
    """Place a placement group on `host` and start worker `worker_id` in it (`spare`: as a hot spare, which waits
    out of every ring, with no deadline, until a generation admits it)."""

    worker_id: str
    host: str
    spare: bool = False


class Kill(NamedTuple):
    """Stop a worker now. `failed`: it was judged failed (hung, stuck), and the core counted it dead already."""

    worker_id: str
    failed: bool = False


class Release(NamedTuple):
    """Free what a worker that is gone still holds (its placement group)."""

    worker_id: str


class Publish(NamedTuple):
    """Put generation `generation` into the KV actor, then notify the previous members still alive."""

    generation: int
    plan: Mapping[str, WorkerSlot]
    notify: tuple[str, ...]


class Abandon(NamedTuple):
    """Tell the live members of `generation` that its ring is dead: they leave even a blocked collective now."""

    generation: int
    worker_ids: tuple[str, ...]
    reason: str


class RestoreKV(NamedTuple):
    """Tell a restarted KV actor the current generation and its plan (no reset: the rings need no keys)."""

    generation: int
    plan: Mapping[str, WorkerSlot]


class QueryActivity(NamedTuple):
    """Ask each member whether it is inside a collective, with `liveness_timeout`; answer with `ActivityReport`."""

    generation: int
    worker_ids: tuple[str, ...]
    requester: str
    reason: str


class LookForCheckpoint(NamedTuple):
    """Does the durable checkpoint exist? Answer with `CheckpointFound`."""


class RequestResources(NamedTuple):
    """Ask Ray's autoscaler for `bundles` worker bundles in all (0 withdraws the request)."""

    bundles: int


class RecordMetric(NamedTuple):
    """One of `metrics.py`'s gauges or counters: world_size, reset, recovery."""

    name: str
    value: float = 0.0


Action = (
    Spawn
    | Kill
    | Release
    | Publish
    | Abandon
    | RestoreKV
    | QueryActivity
    | LookForCheckpoint
    | RequestResources
    | RecordMetric
)
