"""The driver's pure core: the run's membership as data, messages in, actions out.

`DriverCore.handle(messages, now)` applies a batch of messages (see
`messages.py`) and returns the actions the shell must carry out: spawn or
kill workers, publish a generation, query the members' activity, look for a
durable checkpoint, ask the autoscaler for resources. It never waits and
never calls Ray, so every path (a death during a reset, deaths together, a
newcomer dying before admission, `max_failures`, a deadlock, each deadline)
is tested by replaying message scripts in milliseconds (`tests/unit/test_driver_core.py`).

The core composes parts, each deciding one thing over the shared
`RunRecord` (the options, the workers, the hosts, the events, the actions,
and the run's phase, whose every move `phase.py` checks and records):

- `Generations`: who is in the ring, planning and publishing a generation,
  the end of its reset;
- `Finishing`: workers returning, the run's result, an uneven finish;
- `Failures`: deaths, fencing, cool-down, `max_failures`, crash loops,
  every member lost;
- `BrokenRings`: missed pings and a ring broken with everyone alive;
- `Scaling`: the hosts, draining nodes, newcomers and leavers, the autoscaler;
- `PaceWatch`: the ranks' pace, a straggler let go gracefully, its host
  cooled down and offered again (`stragglers.py` decides).

They sit in that order, each built on the ones before it; what needs two
parts at once (an unreachable run, a generation that synced after a
failure) is joined here. A batch's messages are applied in order and the
ring is re-planned once at the end, so deaths that arrive together join one
reset. The judgement calls are the pure functions of `policies.py`; who
goes where is `assignment.py`'s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.broken_rings import BrokenRings
from ray_elastic.driver.core.failures import Failures
from ray_elastic.driver.core.finishing import Finishing
from ray_elastic.driver.core.generations import Generations
from ray_elastic.driver.core.pace_watch import PaceWatch
from ray_elastic.driver.core.policies import PublishVerdict
from ray_elastic.driver.core.roster import ALIVE, WorkerRecord, WorkerStatus
from ray_elastic.driver.core.run_record import RunRecord
from ray_elastic.driver.core.scaling import Scaling
from ray_elastic.protocol import DriverState, EventKind, Finished, RunOutcome, UserError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from ray_elastic.assignment import Plan
    from ray_elastic.config import RunConfig
    from ray_elastic.driver.core.phase import PhaseChange

__all__ = ["ALIVE", "DriverCore", "WorkerRecord", "WorkerStatus"]

logger = logging.getLogger(__name__)


class DriverCore:
    """The membership of one run. Not thread-safe: one loop drives it."""

    def __init__(self, config: RunConfig, wall_offset: float = 0.0, started_at: float = 0.0) -> None:
        """`wall_offset` turns the shell's monotonic `now` into wall-clock event times; `started_at` is monotonic."""
        self.record = RunRecord(config, wall_offset, started_at)
        self.generations = Generations(self.record)
        self.finishing = Finishing(self.record, self.generations)
        self.failures = Failures(self.record, self.generations, self.finishing)
        self.rings = BrokenRings(self.record, self.generations, self.finishing, self.failures)
        self.scaling = Scaling(self.record, self.generations, self.failures.cooldown)
        self.paces = PaceWatch(self.record, self.generations)
        self._replan = True  # a message of this batch may change the plan (besides status changes)
        self._planned = -1  # the roster's version when the plan was last brought in line
        self._benched = -1  # the version of the stragglers' held slots then
        self._release_at: float | None = None  # when the next cooling host is offered again

    # ---- what the shell and fit() read -----------------------------------------------
    @property
    def config(self) -> RunConfig:
        return self.record.config

    @property
    def state(self) -> DriverState:
        """The run's phase (`phase.py` owns it and says what may come next)."""
        return self.record.phase.current

    def phase_changes(self) -> list[PhaseChange]:
        """The newest moves between phases, oldest first, each with its reason: for debugging."""
        return self.record.phase.history()

    @property
    def failure(self) -> str | None:
        return self.record.failure

    @property
    def generation(self) -> int:
        return self.generations.generation

    @property
    def plan(self) -> Plan:
        return self.generations.plan

    @property
    def resets(self) -> int:
        return self.generations.resets

    @property
    def workers(self) -> dict[str, WorkerRecord]:
        return self.record.roster.workers

    @property
    def events(self) -> Any:
        return self.record.events

    @property
    def return_value(self) -> Any:
        return self.finishing.return_value

    @property
    def checkpoint_error(self) -> str | None:
        return self.finishing.checkpoint_error

    @property
    def spares_ready(self) -> int:
        """Hot spares booted and waiting for a place."""
        return self.record.roster.count(WorkerStatus.SPARE)

    def alive_ids(self) -> list[str]:
        return self.record.roster.alive_ids()

    def alive_hosts(self) -> dict[str, str]:
        """Each live worker's host, for the liveness rounds."""
        return {r.worker_id: r.host for r in self.record.roster.live(*ALIVE)}

    def host_of(self, worker_id: str) -> str | None:
        rec = self.record.roster.get(worker_id)
        return rec.host if rec is not None else None

    def outcome(self, metrics_from: int, metrics: list) -> RunOutcome:
        """The run's outcome for `fit()`, with the reports it has not fetched (from run-wide number `metrics_from`)."""
        return RunOutcome(
            ok=self.failure is None,
            error=self.failure,
            value=self.return_value,
            metrics=metrics,
            metrics_from=metrics_from,
            events=[e.to_dict() for e in self.events],
            resets=self.resets,
            checkpoint_error=self.checkpoint_error,
            spares_promoted=self.scaling.spares.promoted,
        )

    def is_void(self, worker_id: str) -> bool:
        """Whether nothing `worker_id` sends counts: declared dead, or no longer on record."""
        return self.record.roster.is_void(worker_id)

    # ---- a restarted driver -----------------------------------------------------
    def restarted(self, now: float, why: str) -> list[m.Action]:
        """This core came back from a snapshot in a restarted driver: the actions that may have been lost.

        The snapshot is written before a batch's actions are carried out, so
        the dead driver may have carried out some, all or none of the last
        batch's. What is asked again is safe to ask twice: the word that a
        ring lost a member (the newest one given, even for the generation
        before the current: its members may still block in it), the current
        generation to the KV actor (kept if it has it), the members'
        activity if a question was out, a checkpoint lookup if one was out,
        and the autoscaler's share. Spawns and kills are the shell's to
        reconcile with what exists (`DriverActor._reattach`): a worker killed
        as failed is already dead to the core, so it is not kept.
        """
        gens = self.generations
        self.record.now = now
        ev = gens.event(EventKind.DRIVER_RESTARTED, f"the run's driver actor restarted ({why})", now)
        ev.reset_duration = 0.0
        self.record.events.append(ev)
        restore = [m.RestoreKV(gens.generation, dict(gens.plan))] if gens.generation else []
        return [
            *self.failures.abandon_again(),
            *restore,
            *self.rings.query_again(),
            *self.failures.look_again(),
            *self.scaling.request_again(),
        ]

    # ---- the one entry point -------------------------------------------------
    def handle(self, messages: Iterable[m.Message], now: float) -> list[m.Action]:
        """Apply `messages` in order, re-plan once if anything the plan depends on changed, return the actions.

        Most batches change nothing the plan reads (a tick, a liveness round
        where everyone answered, discovery offering the same hosts, rank 0's
        reports): re-planning is skipped for them, since at thousands of
        workers it costs milliseconds of the driver's loop per batch. What
        the plan reads changes only through a worker's status (the roster
        counts those changes), the hosts, the draining nodes, a straggler's
        host benched or offered again, a sync, a forced re-form, or time: a
        host's cool-down ending.
        """
        record = self.record
        record.now = now
        batch = list(messages)
        for i, message in enumerate(batch):
            if record.phase.is_final:
                # the run ended in this batch (an uneven finish): rank 0's value, if it came with it, is still kept
                said = [x for x in batch[i:] if not record.roster.is_void(getattr(x, "worker_id", ""))]
                self.finishing.keep_value(said)
                break
            self._apply(message, now)
        due = self._release_at is not None and now >= self._release_at
        changed = record.roster.version != self._planned or self._benched != record.benched.version
        if not record.phase.is_final and (self._replan or due or changed):
            if not self.finishing.active:
                self.scaling.reconcile(now)
            self._maybe_publish(now)
            self._prune(now)
            self._replan = False
            self._planned = record.roster.version
            self._benched = record.benched.version
            self._release_at = self.failures.cooldown.next_release(now)
        return record.take_actions()

    def _maybe_publish(self, now: float) -> None:
        published = self.generations.maybe_publish(now, self.finishing.active)
        if published.verdict is PublishVerdict.ALL_LOST:
            self.failures.all_lost()
        elif published.membership_changed:
            self.rings.membership_changed()

    def _prune(self, now: float) -> None:
        """Forget what no decision needs any more, so a run with churn keeps the driver's size flat.

        A worker that is gone leaves the record once no generation, sync,
        boot announcement or hand-over names it (a late word from it is void
        all the same, `is_void`); a host leaves once it is neither offered
        nor hosting a worker on record; a cool-down, once it is forgotten.
        """
        forgotten = self.record.roster.prune(self.generations.names)
        self.scaling.prune(now)
        self.paces.prune(now, forgotten)

    def _apply(self, msg: m.Message, now: float) -> None:
        """One message, to the part that decides on it (`_HANDLERS`); a void worker's word changes nothing."""
        sender = getattr(msg, "worker_id", None)
        if sender is not None and self.record.roster.is_void(sender):
            # declared dead or let go (killed as hung, cut off and healed, left out): its word is void
            logger.info("ignored %s from worker %s, declared dead", type(msg).__name__, sender)
            return
        handler = _HANDLERS.get(type(msg))
        if handler is None:
            raise TypeError(f"the driver core got an unknown message {msg!r}")
        if msg.changes_plan:
            self._replan = True  # the others change the plan's inputs only through statuses and benched hosts
        handler(self, msg, now)

    # ---- what each message does, where no part takes it whole -------------------------------------------------
    def _on_hosts(self, msg: m.HostsDiscovered, now: float) -> None:
        if self.scaling.update_hosts(msg.hosts, now):
            self._replan = True  # the same hosts again change nothing

    def _on_ready(self, msg: m.WorkerReady, now: float) -> None:
        rec = self.record.roster.get(msg.worker_id)
        if rec is not None and rec.status is WorkerStatus.STARTING:
            self.record.roster.move(rec, WorkerStatus.READY, "it said it is ready")
            rec.heard()  # its process is up: from now on the liveness check applies
        elif rec is not None and rec.status is WorkerStatus.SPARE_BOOTING:
            self.record.roster.move(rec, WorkerStatus.SPARE, "a hot spare, ready")
            rec.heard()

    def _on_exited(self, msg: m.WorkerExited, now: float) -> None:
        if isinstance(msg.outcome, UserError):
            self.failures.on_user_error(msg, now)
        else:
            self.finishing.on_exit(msg)
            self.rings.on_finished(msg.outcome.generation if isinstance(msg.outcome, Finished) else None)

    def _on_start_failed(self, msg: m.WorkerStartFailed, now: float) -> None:
        rec = self.record.roster.get(msg.worker_id)
        where = f" on node {rec.host[:8]}" if rec is not None else ""
        self.record.fail(f"Ray could not start worker {msg.worker_id}{where}: {msg.reason}")

    def _on_synced(self, msg: m.WorkerSynced, now: float) -> None:
        whole, place = self.generations.on_synced(msg)
        if whole:
            self.failures.check_crash_loop(msg.generation, place)

    def _on_data_slow(self, msg: m.DataSlow, now: float) -> None:
        detail = (
            f"block {msg.block} of dataset {msg.dataset!r} took {msg.seconds:.1f} s to produce; its pipeline "
            "was running (slow, not starved of CPUs)"
        )
        self.record.events.append(self.generations.event(EventKind.DATA_SLOW, detail, now, paused=False))

    def _on_backend_note(self, msg: m.BackendNote, now: float) -> None:
        record = self.record
        if not any(e.kind is EventKind.BACKEND_CHANGED and e.detail == msg.reason for e in record.events):
            record.events.append(self.generations.event(EventKind.BACKEND_CHANGED, msg.reason, now, paused=False))

    def _on_tick(self, msg: m.Tick, now: float) -> None:
        self.paces.release(now)
        if not self.generations.check_wait(now, cooling=len(self.failures.cooldown.cooling(now))):
            self.failures.check_boot_deadlines(now)

    def _on_snapshot_refused(self, msg: m.SnapshotRefused, now: float) -> None:
        """A restarted driver found a snapshot older than the run's (written back): say so, and fail with it."""
        self.record.events.append(self.generations.event(EventKind.SNAPSHOT_REFUSED, msg.why, now, paused=False))
        self.record.fail(f"{msg.why}; the restarted driver refused it, and the run cannot go on from it")

    def _on_kv_restarted(self, msg: m.KVRestarted, now: float) -> None:
        """The KV actor came back empty. Between resets that costs nothing: the rings need no keys.

        During a reset (a generation whose ranks still sync, or form their
        ring) the keys its ranks wrote are gone: the ring is formed once more,
        in a new generation with the same members.
        """
        gens = self.generations
        ev = gens.event(EventKind.KV_RESTARTED, f"the rendezvous (KV) actor restarted ({msg.reason})", now)
        ev.reset_duration = 0.0
        self.record.events.append(ev)
        if gens.generation == 0:
            return
        self.record.act(m.RestoreKV(gens.generation, dict(gens.plan)))
        if gens.syncing:
            logger.warning("the KV actor restarted during a reset: generation %d forms again", gens.generation)
            gens.reform()


# every message type, and what takes it: one line each, so a new message cannot be dropped silently
_HANDLERS: dict[type, Callable[[DriverCore, Any, float], None]] = {
    m.HostsDiscovered: DriverCore._on_hosts,
    m.NodesDraining: lambda core, msg, now: core.scaling.on_draining(msg.deadlines, now),
    m.WorkerReady: DriverCore._on_ready,
    m.WorkerExited: DriverCore._on_exited,
    m.WorkerDied: lambda core, msg, now: core.failures.on_died(msg.worker_id, msg.reason, msg.node_alive, now),
    m.WorkerStartFailed: DriverCore._on_start_failed,
    m.WorkerSynced: DriverCore._on_synced,
    m.WorkerResumed: lambda core, msg, now: core.failures.on_resumed(msg, now),
    m.ResetRequested: lambda core, msg, now: core.rings.on_reset_requested(msg),
    m.TrainFnRaised: lambda core, msg, now: core.failures.on_raised(msg, now),
    m.ActivityReport: lambda core, msg, now: core.rings.on_activity(msg, now),
    m.PingResults: lambda core, msg, now: core.rings.on_pings(msg, now),
    m.CheckpointFound: lambda core, msg, now: core.failures.on_checkpoint_found(msg, now),
    m.PacesReported: lambda core, msg, now: core.paces.on_paces(msg, now),
    m.DataSlow: DriverCore._on_data_slow,
    m.BackendNote: DriverCore._on_backend_note,
    m.Tick: DriverCore._on_tick,
    m.PublishFailed: lambda core, msg, now: core.record.fail(
        f"the rendezvous (KV) actor did not take generation {msg.generation}: {msg.reason}"
    ),
    m.KVRestarted: DriverCore._on_kv_restarted,
    m.KVLost: lambda core, msg, now: core.record.fail(
        f"the run's rendezvous (KV) actor died ({msg.reason}); workers cannot form rings"
    ),
    m.DiscoveryFailed: lambda core, msg, now: core.record.fail(msg.reason),
    m.Stop: lambda core, msg, now: core.record.fail(msg.reason),
    m.DriverFailed: lambda core, msg, now: core.record.fail(msg.reason),
    m.SnapshotRefused: DriverCore._on_snapshot_refused,
}
