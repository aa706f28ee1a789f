"""The run's workers as the driver's core records them: who exists, where, since when, in which status.

Every part of the core reads the roster; only the parts that decide a
worker's fate change its status (scaling starts and lets go, failures
declare dead, generations admit, finishing records an exit), and only
through `Roster.move`, which checks the move against `MOVES` and keeps its
reason (`WorkerRecord.reason`), as `phase.py` does for the run's phase. A
worker declared dead or let go is fenced: nothing it sends counts any
more, even when it comes back from a partition that healed.

At thousands of workers the roster is on the driver's hot path: each batch
asks who is starting, ready or gone, and the driver's snapshot pickles it
after every batch. So the workers are also kept by status (a status change
moves the record between buckets, and bumps `version`, which tells the core
that something it plans from changed); every move is also written to a
short journal (`Journal`), from which the planners tell what changed since
they last planned (a death: one member gone) without a pass over every
worker; and the roster pickles as columns, written whole now and then
(`_BASE`) and otherwise as the rows changed since, so a snapshot after a
death re-pickles the few records it changed.
"""

from __future__ import annotations

import copyreg
import enum
import pickle
from collections.abc import Collection
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

from ray_elastic.assignment import OUT_OF_BAND, LiveWorker

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


class WorkerStatus(enum.Enum):
    STARTING = "starting"  # placement group, actor start, train_fn set-up
    READY = "ready"  # entered the run loop, waits to be admitted
    MEMBER = "member"  # part of the current generation
    LEAVING = "leaving"  # left out of the next generation, exits at its next check
    FINISHED = "finished"  # train_fn returned
    GONE = "gone"  # died, removed or killed
    SPARE_BOOTING = "spare booting"  # a hot spare: placement group, actor start, train_fn set-up
    SPARE = "spare"  # a hot spare booted: in the run loop, out of every ring, until a place opens (`Scaling`)


# from each status, the statuses a move may reach; FINISHED and GONE are final
MOVES: dict[WorkerStatus, frozenset[WorkerStatus]] = {
    # it said it is ready; it died or was let go before
    WorkerStatus.STARTING: frozenset({WorkerStatus.READY, WorkerStatus.GONE}),
    # a generation admitted it; it died or was let go before
    WorkerStatus.READY: frozenset({WorkerStatus.MEMBER, WorkerStatus.GONE}),
    # withdrawn, drained or let go as a straggler; it returned from train_fn; it died, exited or was let go
    WorkerStatus.MEMBER: frozenset({WorkerStatus.LEAVING, WorkerStatus.FINISHED, WorkerStatus.GONE}),
    # offered again, or held over to hand the state on; it returned; it died or exited
    WorkerStatus.LEAVING: frozenset({WorkerStatus.MEMBER, WorkerStatus.FINISHED, WorkerStatus.GONE}),
    WorkerStatus.FINISHED: frozenset(),
    WorkerStatus.GONE: frozenset(),
    # it booted; promoted while still booting (a newcomer from then on); it died or was let go before
    WorkerStatus.SPARE_BOOTING: frozenset({WorkerStatus.SPARE, WorkerStatus.STARTING, WorkerStatus.GONE}),
    # promoted into a place (admitted with the next generation, as any ready newcomer); died or let go before
    WorkerStatus.SPARE: frozenset({WorkerStatus.READY, WorkerStatus.GONE}),
}


class StatusError(RuntimeError):
    """A move `MOVES` does not allow: the core's bookkeeping is wrong, and the run must not go on on it."""


ALIVE = frozenset(
    {
        WorkerStatus.STARTING,
        WorkerStatus.READY,
        WorkerStatus.MEMBER,
        WorkerStatus.LEAVING,
        WorkerStatus.SPARE_BOOTING,
        WorkerStatus.SPARE,
    }
)
SPARES = frozenset({WorkerStatus.SPARE_BOOTING, WorkerStatus.SPARE})
IN_RING = frozenset({WorkerStatus.MEMBER, WorkerStatus.LEAVING})
_STATUSES = tuple(WorkerStatus)
_BY_SEQ = attrgetter("seq")


class WorkerRecord:
    """One worker on record; `Roster.move` changes its status."""

    __slots__ = (
        "worker_id",
        "host",
        "seq",
        "started_at",
        "answered",
        "silent_since",
        "spared",
        "live",
        "admitted_in",
        "reason",
        "_status",
        "_roster",
    )

    def __init__(self, roster: Roster, worker_id: str, host: str, seq: int, status: WorkerStatus, started_at: float):
        self._roster = roster
        self.worker_id = worker_id
        self.host = host
        self.seq = seq  # spawn order: smaller is older
        self.started_at = started_at  # monotonic
        self.answered = False  # has answered a ping or said it is ready: its process is up
        self.silent_since: float | None = None  # when the pings it has not answered since began (monotonic)
        self.spared = False  # silent but computing: spared by the liveness check
        self.live = LiveWorker(worker_id, host, seq)  # what the pure planners take, made once
        self.admitted_in = 0  # the generation that made it a member (0: not admitted yet)
        self.reason = "started"  # why it is in its status (`Roster.move`)
        self._status = status

    @property
    def status(self) -> WorkerStatus:
        """Its status; changed only by `Roster.move`."""
        return self._status

    def heard(self) -> None:
        """It answered (a ping, or said it is ready): its process is up, and any silence is over."""
        self.answered, self.silent_since, self.spared = True, None, False
        self._roster.unsettled.discard(self.worker_id)
        self._roster.changed[self.worker_id] = None

    def went_silent(self, since: float) -> None:
        """It missed a ping; its silence counts from `since` until it answers again."""
        if self.silent_since is None:
            self.silent_since = since
        self._roster.unsettled.add(self.worker_id)
        self._roster.changed[self.worker_id] = None

    def spare(self) -> None:
        """It is silent but computing: the liveness check spares it (until `collective_timeout`)."""
        self.spared = True
        self._roster.changed[self.worker_id] = None

    def admit(self, generation: int) -> None:
        """`generation` made it a member."""
        self.admitted_in = generation
        self._roster.changed[self.worker_id] = None

    @property
    def holds_state(self) -> bool:
        """Whether it finished a sync, so it holds the trained state (the newest commit, with its generation)."""
        return self.live.holds

    def took_state(self) -> None:
        """It finished a sync: from now on it ranks before every newcomer (`assignment.assign_ranks`)."""
        if not self.live.holds:
            self.live = self.live._replace(holds=True)
            self._roster.changed[self.worker_id] = None
            self._roster.journal.note(self.worker_id, self._status, self._status)

    def __repr__(self) -> str:
        return f"WorkerRecord({self.worker_id!r}, {self.host[:8]!r}, seq={self.seq}, {self._status.value})"


class Moved(NamedTuple):
    """One entry of the journal: a worker's status before and after (`before is after`: it took the state;
    `before` None: it was recorded)."""

    worker_id: str
    before: WorkerStatus | None
    after: WorkerStatus


class Journal:
    """The roster's changes, in order, for the planners to tell what changed since they last planned.

    A planner keeps a `mark` and asks `since(mark)` for what changed after
    it: None when the journal was cleared in between (it grew past `LIMIT`:
    then the planner plans whole, as it does after a restart, when no mark
    exists). Never pickled.
    """

    LIMIT = 4096

    def __init__(self) -> None:
        self.entries: list[Moved] = []
        self.epoch = 0

    def note(self, worker_id: str, before: WorkerStatus | None, after: WorkerStatus) -> None:
        if len(self.entries) >= self.LIMIT:
            self.entries = []
            self.epoch += 1
        self.entries.append(Moved(worker_id, before, after))

    def mark(self) -> tuple[int, int]:
        return self.epoch, len(self.entries)

    def since(self, mark: tuple[int, int] | None) -> list[Moved] | None:
        if mark is None or mark[0] != self.epoch:
            return None
        return self.entries[mark[1] :]


class InStatus(Collection[str]):
    """The workers in some statuses, as a collection that asks each one's status (no set of every id built)."""

    def __init__(self, roster: Roster, statuses: frozenset[WorkerStatus]) -> None:
        self._roster, self._statuses = roster, statuses

    def __contains__(self, worker_id: object) -> bool:
        rec = self._roster.workers.get(worker_id)  # type: ignore[call-overload]
        return rec is not None and rec.status in self._statuses

    def __len__(self) -> int:
        return self._roster.count(*self._statuses)

    def __iter__(self) -> Iterator[str]:
        return iter(self._roster.ids(*self._statuses))


# the roster's columns are pickled whole again once this share of its workers changed since (else as rows)
_BASE = 8


class Roster:
    """The workers on record, by id and by status; one gone leaves the record once nothing names it (`prune`)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        self._by_status: dict[WorkerStatus, dict[str, WorkerRecord]] = {s: {} for s in _STATUSES}
        # workers declared dead and still on record; one no longer on record (pruned) is just as void
        self.fenced: set[str] = set()
        # workers whose record an answer changes (not answered yet, or silent): a liveness round where
        # everyone answered touches only these, not every worker
        self.unsettled: set[str] = set()
        self._seq = 0
        self.version = 0  # bumped by every change the core plans from
        self.journal = Journal()
        # the workers whose record changed since `_base` (the columns last pickled whole); None: pruned
        self.changed: dict[str, None] = {}
        self._base: bytes | None = None

    def new(self, host: str, now: float, spare: bool = False) -> WorkerRecord:
        """Record a worker about to be started on `host` (a hot spare: `spare`); ids and seqs grow with spawn
        order."""
        self._seq += 1
        status = WorkerStatus.SPARE_BOOTING if spare else WorkerStatus.STARTING
        rec = WorkerRecord(self, f"w{self._seq}", host, self._seq, status, now)
        self.workers[rec.worker_id] = rec
        self._by_status[status][rec.worker_id] = rec
        self.unsettled.add(rec.worker_id)
        self.version += 1
        self.changed[rec.worker_id] = None
        self.journal.note(rec.worker_id, None, status)
        return rec

    def move(self, rec: WorkerRecord, to: WorkerStatus, reason: str) -> None:
        """The one place a worker's status changes: checked against `MOVES`, its reason kept; the same status is
        no move. `StatusError` for a move the table does not allow."""
        old = rec._status
        if to is old:
            return
        if to not in MOVES[old]:
            raise StatusError(f"worker {rec.worker_id} cannot move from {old.value} to {to.value} ({reason})")
        del self._by_status[old][rec.worker_id]
        self._by_status[to][rec.worker_id] = rec
        rec._status, rec.reason = to, reason
        self.version += 1
        self.changed[rec.worker_id] = None
        self.journal.note(rec.worker_id, old, to)

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self.workers.get(worker_id)

    def __getitem__(self, worker_id: str) -> WorkerRecord:
        return self.workers[worker_id]

    def live(self, *statuses: WorkerStatus) -> list[WorkerRecord]:
        """The workers in `statuses`, oldest first."""
        if len(statuses) == 1:
            found = list(self._by_status[statuses[0]].values())
        else:
            found = [r for s in statuses for r in self._by_status[s].values()]
        found.sort(key=_BY_SEQ)  # nearly sorted already: linear in practice
        return found

    def count(self, *statuses: WorkerStatus) -> int:
        return sum(len(self._by_status[s]) for s in statuses)

    def any(self, *statuses: WorkerStatus) -> bool:
        return any(self._by_status[s] for s in statuses)

    def ids(self, *statuses: WorkerStatus) -> set[str]:
        """The ids of the workers in `statuses` (a set: for membership tests against a plan)."""
        return {w for s in statuses for w in self._by_status[s]}

    def in_status(self, *statuses: WorkerStatus) -> InStatus:
        """The workers in `statuses`, for membership tests, without building a set of them."""
        return InStatus(self, frozenset(statuses))

    def alive_ids(self) -> list[str]:
        return [r.worker_id for r in self.live(*ALIVE)]

    def is_void(self, worker_id: str) -> bool:
        """Whether nothing `worker_id` sends counts: declared dead, or no longer on record."""
        return worker_id in self.fenced or worker_id not in self.workers

    def hosts_in_use(self) -> set[str]:
        return {r.host for r in self.workers.values()}

    def prune(self, named: Callable[[str], bool]) -> list[str]:
        """Forget the workers that are gone and that no generation, sync or boot announcement names (`named`).

        Returns the workers forgotten. Only the gone are looked at: a few, at any size.
        """
        gone = [w for w in self._by_status[WorkerStatus.GONE] if not named(w)]
        for worker_id in gone:
            del self.workers[worker_id], self._by_status[WorkerStatus.GONE][worker_id]
            self.fenced.discard(worker_id)
            self.unsettled.discard(worker_id)
            self.changed[worker_id] = None
        return gone

    # ---- the snapshot: columns, not one pickled object per worker ---------------------
    def __getstate__(self) -> dict[str, Any]:
        """The columns as last pickled whole (bytes, reused) and the rows changed since; whole again once
        more than 1/`_BASE` of the workers changed, so a batch pickles about what it changed."""
        if self._base is None or len(self.changed) > max(64, len(self.workers) // _BASE):
            self._base = pickle.dumps(_columns(list(self.workers.values())), protocol=pickle.HIGHEST_PROTOCOL)
            self.changed = {}
        rows = {w: _row(self.workers[w]) if w in self.workers else None for w in self.changed}
        return {"base": self._base, "rows": rows, "fenced": self.fenced, "seq": self._seq, "version": self.version}

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """The columns' bytes go out of band where the pickler takes buffers (the driver's snapshot: a part of
        its own in the GCS, written once per base)."""
        state = self.__getstate__()
        if protocol >= 5 and len(state["base"]) >= OUT_OF_BAND:
            state["base"] = pickle.PickleBuffer(state["base"])
        return (copyreg.__newobj__, (Roster,), state)  # type: ignore[attr-defined]

    def __setstate__(self, state: dict[str, Any]) -> None:
        Roster.__init__(self)
        self.fenced, self._seq, self.version = state["fenced"], state["seq"], state["version"]
        columns = pickle.loads(state["base"])  # the driver's own snapshot, signed (`driver/shell/snapshot.py`)
        rows = dict(zip(columns["ids"], _rows(columns), strict=True))
        for worker_id, row in state["rows"].items():
            if row is None:
                rows.pop(worker_id, None)
            else:
                rows[worker_id] = row  # a changed one in place, a new one last: the record's order
        for worker_id, row in rows.items():
            self._add(worker_id, row)
        self._base = bytes(state["base"]) if not state["rows"] else None

    def _add(self, worker_id: str, row: tuple[Any, ...]) -> None:
        host, seq, status, started, answered, silent, spared, holds, admitted, reason = row
        rec = WorkerRecord(self, worker_id, host, seq, _STATUSES[status], started)
        rec.answered, rec.silent_since, rec.spared = bool(answered), silent, bool(spared)
        rec.admitted_in, rec.reason = admitted, reason
        if holds:
            rec.live = rec.live._replace(holds=True)
        if not answered or silent is not None:
            self.unsettled.add(worker_id)
        self.workers[worker_id] = rec
        self._by_status[rec.status][worker_id] = rec


def _row(r: WorkerRecord) -> tuple[Any, ...]:
    """One worker's record as a row of the snapshot (the columns' order)."""
    status = _STATUSES.index(r._status)
    return (
        r.host,
        r.seq,
        status,
        r.started_at,
        r.answered,
        r.silent_since,
        r.spared,
        r.live.holds,
        r.admitted_in,
        r.reason,
    )


def _rows(columns: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
    silent, spared = columns["silent"], set(columns["spared"])
    for worker_id, host, seq, status, started, answered, holds, admitted, reason in zip(
        columns["ids"],
        columns["hosts"],
        columns["seqs"],
        columns["statuses"],
        columns["started"],
        columns["answered"],
        columns["holds"],
        columns["admitted"],
        columns["reasons"],
        strict=True,
    ):
        yield (
            host,
            seq,
            status,
            started,
            answered,
            silent.get(worker_id),
            worker_id in spared,
            holds,
            admitted,
            reason,
        )


def _columns(recs: list[WorkerRecord]) -> dict[str, Any]:
    """The workers as columns: pickle writes a list of strings or a bytes in C, a record per worker in Python."""
    return {
        "ids": [r.worker_id for r in recs],
        "hosts": [r.host for r in recs],
        "seqs": [r.seq for r in recs],
        "statuses": bytes(_STATUSES.index(r._status) for r in recs),
        "started": [r.started_at for r in recs],
        "answered": bytes(r.answered for r in recs),
        "silent": {r.worker_id: r.silent_since for r in recs if r.silent_since is not None},
        "spared": [r.worker_id for r in recs if r.spared],
        "holds": bytes(r.live.holds for r in recs),
        "admitted": [r.admitted_in for r in recs],
        "reasons": [r.reason for r in recs],
    }
