"""The run's workers as the driver's core records them: who exists, where, since when, in which status.

Every part of the core reads the roster; only the parts that decide a
worker's fate change its status (scaling starts and lets go, failures
declare dead, generations admit, finishing records an exit). A worker
declared dead is fenced: nothing it sends counts any more, even when it
comes back from a partition that healed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WorkerStatus(enum.Enum):
    STARTING = "starting"  # placement group, actor start, train_fn set-up
    READY = "ready"  # entered the run loop, waits to be admitted
    MEMBER = "member"  # part of the current generation
    LEAVING = "leaving"  # left out of the next generation, exits at its next check
    FINISHED = "finished"  # train_fn returned
    GONE = "gone"  # died, removed or killed


ALIVE = frozenset({WorkerStatus.STARTING, WorkerStatus.READY, WorkerStatus.MEMBER, WorkerStatus.LEAVING})
IN_RING = frozenset({WorkerStatus.MEMBER, WorkerStatus.LEAVING})


@dataclass
class WorkerRecord:
    worker_id: str
    host: str
    seq: int  # spawn order: smaller is older
    status: WorkerStatus
    started_at: float  # monotonic
    answered: bool = False  # has answered a ping or said it is ready: its process is up
    silent_since: float | None = None  # when the pings it has not answered since began (monotonic)
    spared: bool = False  # silent but computing: spared by the liveness check


class Roster:
    """The workers on record, by id; a worker gone leaves the record once nothing names it (`prune`)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        # workers declared dead and still on record; one no longer on record (pruned) is just as void
        self.fenced: set[str] = set()
        self._seq = 0

    def new(self, host: str, now: float) -> WorkerRecord:
        """Record a worker about to be started on `host`; ids and seqs grow with spawn order."""
        self._seq += 1
        rec = WorkerRecord(f"w{self._seq}", host, self._seq, WorkerStatus.STARTING, now)
        self.workers[rec.worker_id] = rec
        return rec

    def get(self, worker_id: str) -> WorkerRecord | None:
        return self.workers.get(worker_id)

    def __getitem__(self, worker_id: str) -> WorkerRecord:
        return self.workers[worker_id]

    def live(self, *statuses: WorkerStatus) -> list[WorkerRecord]:
        return [r for r in self.workers.values() if r.status in statuses]

    def alive_ids(self) -> list[str]:
        return [r.worker_id for r in self.workers.values() if r.status in ALIVE]

    def is_void(self, worker_id: str) -> bool:
        """Whether nothing `worker_id` sends counts: declared dead, or no longer on record."""
        return worker_id in self.fenced or worker_id not in self.workers

    def hosts_in_use(self) -> set[str]:
        return {r.host for r in self.workers.values()}

    def prune(self, named: set[str]) -> None:
        """Forget the workers that are gone and that no generation, sync or boot announcement names."""
        for worker_id in [w for w, r in self.workers.items() if r.status is WorkerStatus.GONE and w not in named]:
            del self.workers[worker_id]
            self.fenced.discard(worker_id)
