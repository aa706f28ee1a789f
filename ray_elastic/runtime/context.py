"""The runtime of one worker process: the parts in `ray_elastic.runtime`, behind one object.

Each worker actor holds one `WorkerContext` for its whole life (a
process-wide singleton, since one actor is one process; the worker actor
makes it current and `current()` finds it). It holds what lives as long as
the process: the worker's id, the run's settings, the driver link and the
KV client (through `Membership`), the commit count, the checkpoint cadence,
the metrics shipper, the activity marks and the run token. It delegates to
parts with one job each:

- `Membership`: the ring, joins and resets, host-change notices;
- `CheckpointCadence`: durable checkpoints every `checkpoint_every` commits;
- `MetricsShipper`: rank 0's metrics and every rank's pace summaries
  (`runtime/pace.py`), shipped in the background;
- `ActivityMarks`: when the worker last entered or left a collective.

What changes every generation (its number, this worker's rank and slot,
the ring) it hands out as a `Generation` value (`runtime/generation.py`):
`joined()` joins first, `generation_now()` does not. A function that works
on one generation takes that value; one that needs the process takes the
context: each says which in its signature. Only the public entry points
(`ray_elastic.rank()`, the collectives, `report()`, `prepare_model()` ...)
find the context through `runtime.process.current()`; the state classes,
the torch helpers and the run loop are handed it (at construction, by
default the process's). None reaches through it to its parts.

Tests set `fault_hook`, `last_activity` and `in_collective` on it, and a
generation (`membership.group`, `.slot`, `.generation`) on its membership.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_elastic import metrics
from ray_elastic.collective.activity import MARKS
from ray_elastic.exceptions import StateRegressionError
from ray_elastic.rendezvous import KVClient
from ray_elastic.runtime.boot_marks import BootMarks
from ray_elastic.runtime.checkpoint_cadence import CheckpointCadence
from ray_elastic.runtime.commits import CommitId, judge_adoption
from ray_elastic.runtime.generation import Generation
from ray_elastic.runtime.membership import Membership
from ray_elastic.runtime.metrics_shipper import MetricsShipper, snapshot
from ray_elastic.runtime.pace import PACE

if TYPE_CHECKING:
    from collections.abc import Callable

    import ray

    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.protocol import WorkerConfig
    from ray_elastic.wire import DriverLink


class WorkerContext:
    """This worker process's runtime: its membership, commits, checkpoints and metrics; generations it hands out.

    Args:
        worker_id: this worker's id in the driver's assignments.
        kv: the run's KV actor.
        driver: the driver actor (told what happens here, `wire.py`, and
            sent the metrics).
        settings: the run's options a worker needs.
    """

    def __init__(
        self,
        worker_id: str,
        kv: ray.actor.ActorHandle,
        driver: DriverLink,
        settings: WorkerConfig,
    ) -> None:
        self.worker_id = worker_id
        self.settings = settings
        self.activity = MARKS  # the backends mark it (collective/activity.py)
        self.boot_marks = BootMarks()  # when this process passed each point of its boot (runtime/boot_marks.py)
        self.membership = Membership(worker_id, KVClient(kv), driver, settings, self.boot_marks)
        self.checkpoints = CheckpointCadence(worker_id, driver, settings, self.membership.kv)
        self.metrics = MetricsShipper(worker_id, driver)
        PACE.sink = self.metrics.add_pace  # this rank's pace rides in its metrics batches (straggler watch)
        self._before_join: list[tuple[float, dict[str, Any]]] = []  # report()s made before this worker had a rank
        # commits the state holds (rank 0's after each sync): where training resumes; it runs on across
        # generations (each sync adopts rank 0's count), so it lives here, with the process, not in a Generation
        self.commits = 0
        self.run_token: Any = None  # the worker actor's `RunToken`, for calls to the run's other actors (the feed)

    # ---- generations: what changes at each reset -------------------------------
    def joined(self) -> Generation:
        """The generation this worker is in, joining the ring first if needed (the first time, or after a reset)."""
        self.membership.ensure_joined()
        return self._view()

    def generation_now(self) -> Generation | None:
        """The generation this worker is in, or None while it is in no ring (before its first join)."""
        return None if self.membership.group is None else self._view()

    def _view(self) -> Generation:
        m = self.membership
        assert m.slot is not None and m.group is not None  # joining sets both
        return Generation(m.generation, m.slot, m.group)

    @property
    def generation(self) -> int:
        """The number of the newest generation this worker joined (0: none yet)."""
        return self.membership.generation

    @property
    def slot(self) -> WorkerSlot | None:
        """This worker's slot in the newest generation it joined, or None before it joined one.

        The worker actor reads it once `train_fn` returned (its outcome says
        the rank); code inside a generation takes `joined()` instead.
        """
        return self.membership.slot

    @property
    def notice(self) -> int:
        """The newest generation the driver announced to this worker (beyond its own: a reset awaits)."""
        return self.membership.notice

    @property
    def fault_hook(self) -> Callable[[str], None] | None:
        return self.membership.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[str], None] | None) -> None:
        self.membership.fault_hook = hook

    @property
    def synced_generation(self) -> int:
        """The last generation this rank finished its sync in (0: never)."""
        return self.membership.synced_generation

    @property
    def backend(self) -> str:
        """The run's collective backend ("gloo", "pygloo" or "nccl")."""
        return self.settings.backend

    @property
    def run_id(self) -> str:
        return self.settings.run_id

    @property
    def dataset_names(self) -> tuple[str, ...]:
        """The names of the run's Ray Datasets (`get_dataset_shard`)."""
        return self.settings.datasets

    def add_join_preparation(self, prepare: Callable[[], None]) -> None:
        """Run `prepare()` before this worker announces it is ready (a newcomer warms up first)."""
        self.membership.add_join_preparation(prepare)

    def add_ring_error_check(self, check: Callable[[BaseException], bool]) -> None:
        """`check(error)` tells whether an error raised by a helper's own collectives is a ring failure."""
        self.membership.add_ring_error_check(check)

    def agree_on_notice_later(self, pending: Callable[[], bool]) -> None:
        self.membership.agree_on_notice_later(pending)

    def agree_on_notice_deferred(self, start: Callable[[], Callable[[], bool]]) -> None:
        self.membership.agree_on_notice_deferred(start)

    def post_lasting(self, key: str, value: bytes) -> None:
        """Post `value` under `key` in the run's KV actor, kept across generations."""
        self.membership.kv.post_lasting(key, value)

    def get_lasting(self, key: str) -> bytes | None:
        """What `post_lasting` posted under `key`, or None."""
        return self.membership.kv.get_lasting(key)

    def reset(self, failed: bool) -> None:
        """Leave the current ring and join the next generation."""
        self.membership.reset(failed)

    def tell_failure(self, reason: str = "collective failed") -> None:
        """Tell the driver now that this ring failed, and why; `reset(failed=True)` then does not tell it again."""
        self.membership.tell_failure(reason)

    def tell_raised(self, error: str, traceback: str) -> None:
        """Tell the driver that `train_fn` raised here, and leave the ring (see `Membership.tell_raised`)."""
        self.membership.tell_raised(error, traceback)

    def notify(self, generation: int) -> None:
        self.membership.notify(generation)

    def abandon(self, generation: int, reason: str) -> None:
        self.membership.abandon(generation, reason)

    def agree_on_notice(self, pending: bool) -> None:
        self.membership.agree_on_notice(pending)

    def check_host_updates(self) -> None:
        self.membership.check_host_updates()

    def ring_failure(self, error: BaseException) -> str | None:
        return self.membership.ring_failure(error)

    def mark_synced(self) -> None:
        """Tell the driver this rank synced, and from which commit training resumes."""
        self.membership.mark_synced(self.commits)
        self.boot_marks.mark("synced")

    # ---- activity, for the driver's stuck-rank check ---------------------------
    @property
    def last_activity(self) -> float:
        return self.activity.last

    @last_activity.setter
    def last_activity(self, at: float) -> None:
        self.activity.last = at

    @property
    def in_collective(self) -> bool:
        return self.activity.in_collective

    @in_collective.setter
    def in_collective(self, inside: bool) -> None:
        self.activity.in_collective = inside

    # ---- commits and durable checkpoints -----------------------------------------
    def after_commit(self, state: Any, save_seconds: float) -> None:
        """Count the commit and record its cost; rank 0 checkpoints every `checkpoint_every`-th commit."""
        self.commits += 1
        self.membership.committing()
        metrics.commit(self.settings.run_id, save_seconds)
        now = self.generation_now()  # None: a commit before the first join, never checkpointed
        slot, number = (None, self.generation) if now is None else (now.slot, now.number)
        self.checkpoints.after_commit(state, slot, number, self.commits)

    def maybe_resume(self, generation: Generation, state: Any) -> None:
        """Before `generation`'s sync: a rank 0 that never synced loads the durable checkpoint, if there is one."""
        ever_synced = self.membership.synced_generation != 0
        meta = self.checkpoints.maybe_resume(state, generation.slot, ever_synced=ever_synced)
        if meta is not None:
            self.commits = int(meta.get("commit", 0))

    def fall_back_to_durable(self, generation: Generation, state: Any, reason: str) -> bool:
        """Rank 0 of `generation`: load the newest durable checkpoint into `state` (an event says `reason`)."""
        meta = self.checkpoints.load_newest(state, generation.slot, reason)
        if meta is None:
            return False
        self.commits = int(meta.get("commit", 0))
        return True

    def adopt_commits(self, generation: Generation, held: CommitId) -> None:
        """Before `generation`'s sync: every rank takes rank 0's commit count, after checking it is not going back.

        Rank 0's commit may be older than `held` (this rank's) only within
        one history (the same lineage: a step torn by a failure is rolled
        back to the commit every rank reached). From another history, rank 0
        must have seen at least as many commits, or the sync would overwrite
        trained state with older state: `StateRegressionError`, loudly.
        """
        lineage, commits = generation.ring.broadcast_object((held.lineage, self.commits), root_rank=0)
        verdict = judge_adoption(held.lineage, self.commits, lineage, int(commits))
        if verdict is not None:
            raise StateRegressionError(
                f"rank {generation.rank} of generation {generation.number} (worker {self.worker_id}): {verdict}"
            )
        self.commits = int(commits)

    def flush_checkpoint(self) -> str | None:
        """None if the last durable checkpoint was written, else why not."""
        return self.checkpoints.flush()

    # ---- metrics --------------------------------------------------------------
    def report(self, values: dict[str, Any]) -> None:
        """Buffer rank 0's metrics for the driver (the other ranks' are not kept).

        Every rank checks and copies them at the call (`snapshot`), so a bad
        value fails the same way whichever rank is 0. Reports made before the
        worker joined the ring wait until it knows its rank.
        """
        stamped = snapshot(values)
        if self.slot is None:
            self._before_join.append(stamped)
            return
        self._ship_before_join()
        if self.slot.rank == 0:
            self.metrics.add(stamped)

    def _ship_before_join(self) -> None:
        early, self._before_join = self._before_join, []
        if self.slot is not None and self.slot.rank == 0:
            for stamped in early:
                self.metrics.add(stamped)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Deliver the last metrics, then leave the ring, before the worker returns."""
        self._ship_before_join()
        self.metrics.shutdown(timeout)
        self.membership.close_group()
