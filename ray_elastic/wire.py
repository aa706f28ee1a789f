"""What the run's actors tell the driver: one class per fact, one method to take them all, a typed handle.

Workers (and the feed actor) tell the driver what happened to them by
sending one of the `Told` classes below through `DriverActor.tell(message)`;
the driver queues it for its core as it is, so a new fact is one class here
and one handler in the core (`driver/core/driver_core.py`), and the core's
`Message` union names every class. The handle the workers hold is typed as
`DriverLink`, so mypy checks each call across the process boundary.

Every message of the core (these and the shell's own, `driver/core/
messages.py`) declares its traits on its class (`Fact`):

- `changes_plan`: whether it can change what the next generation is planned
  from (the others change it only through statuses the core counts);
- `quiet`: whether, alone, it never needs the core written to the snapshot
  again (what it decides comes with actions, or with an event the next
  batch writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping


class Fact:
    """A message of the driver's core, with its traits (see the module's docstring)."""

    changes_plan: ClassVar[bool] = True
    quiet: ClassVar[bool] = False


class Told(Fact):
    """A fact one of the run's actors tells the driver through `DriverActor.tell`."""


@dataclass(frozen=True)
class WorkerReady(Told):
    """The worker's process is up and its backend imported: it can be admitted to a generation."""

    worker_id: str


@dataclass(frozen=True)
class WorkerSynced(Told):
    worker_id: str
    generation: int
    at: float  # the worker's wall clock when its sync ended
    commits: int | None = None  # commits the synced state has seen: where training resumes


@dataclass(frozen=True)
class WorkerResumed(Told):
    """Rank 0 loaded the durable checkpoint; `meta` is the checkpoint's own."""

    worker_id: str
    meta: Mapping[str, Any]


@dataclass(frozen=True)
class ResetRequested(Told):
    """A rank's ring broke; the core decides whether a death explains it."""

    worker_id: str
    generation: int
    reason: str


@dataclass(frozen=True)
class TrainFnRaised(Told):
    """A rank's `train_fn` raised in `generation`; the rank stays, waiting to re-enter from the last commit.

    Ray Train counts failures of the run, not exceptions of ranks: every
    rank that raises in one generation (one attempt) is one failure of
    `max_failures`, and nobody is killed for it.
    """

    worker_id: str
    generation: int
    error: str
    traceback: str


@dataclass(frozen=True)
class DataSlow(Told):
    """A dataset's block came only after a wait as long as a starved pipeline would fail in, its pipeline running."""

    changes_plan: ClassVar[bool] = False

    dataset: str
    block: int
    seconds: float


@dataclass(frozen=True)
class BackendNote(Told):
    """Rank 0's ring runs another backend than the run asked for (ranks sharing a GPU), and why."""

    changes_plan: ClassVar[bool] = False

    reason: str


# every fact the run's actors tell: `DriverActor.tell` takes these (a test holds the core's union to them)
ToldMessage = WorkerReady | WorkerSynced | WorkerResumed | ResetRequested | TrainFnRaised | DataSlow | BackendNote


# ---- the handle the run's actors hold ----------------------------------------------------
class _Tell(Protocol):
    def remote(self, message: ToldMessage) -> Any: ...


class _AddMetrics(Protocol):
    def remote(
        self,
        worker_id: str,
        batch: list[tuple[float, dict[str, Any]]],
        seq: int | None = None,
        paces: list[Any] | None = None,
    ) -> Any: ...


class DriverLink(Protocol):
    """The driver actor as the workers call it (an `auth.Authed` handle: each call carries the run's token)."""

    @property
    def tell(self) -> _Tell: ...

    @property
    def add_metrics(self) -> _AddMetrics: ...
