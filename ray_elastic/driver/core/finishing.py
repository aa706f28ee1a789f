"""Finishing: workers returning from `train_fn`, the run's result, and an uneven finish.

The run ends DONE once a worker returned and every other member of its
generation has ended too; its result is what rank 0 returned. It cannot
succeed when ranks do not finish together (a ring breaks after one of them
returned) or when rank 0 is lost after a peer returned: its value, the
run's result, is gone with it. Both fail the run with words that say so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.roster import IN_RING, SPARES, WorkerRecord, WorkerStatus
from ray_elastic.protocol import CoordinatorLost, Finished

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ray_elastic.driver.core.generations import Generations
    from ray_elastic.driver.core.run_record import RunRecord


class Finishing:
    """Rank 0's value and the end of the run."""

    def __init__(self, record: RunRecord, generations: Generations) -> None:
        self.record = record
        self.generations = generations
        self.return_value: Any = None
        self.returned = False  # rank 0's train_fn returned its value: the run may end DONE
        self.checkpoint_error: str | None = None  # rank 0 finished but its last durable checkpoint was not written

    @property
    def active(self) -> bool:
        """A worker's train_fn returned: the run ends once the other members end too."""
        return self.record.roster.any(WorkerStatus.FINISHED)

    def on_exit(self, msg: m.WorkerExited) -> None:
        """A worker's `run()` returned: finished, removed, or lost its driver (a `UserError` is for `Failures`)."""
        record = self.record
        rec = record.roster.get(msg.worker_id)
        if rec is None:
            return
        outcome = msg.outcome
        if isinstance(outcome, CoordinatorLost):
            record.fail(outcome.error)
            return
        if isinstance(outcome, Finished):
            record.roster.move(rec, WorkerStatus.FINISHED, f"returned from train_fn (rank {outcome.rank})")
        else:
            record.roster.move(rec, WorkerStatus.GONE, "left the run (removed)")
        record.act(m.Kill(rec.worker_id))
        if isinstance(outcome, Finished):
            if outcome.rank == 0:
                self.return_value = outcome.value
                self.checkpoint_error = outcome.checkpoint_error
                self.returned = True
            for other in record.roster.live(WorkerStatus.STARTING, WorkerStatus.READY, *SPARES):
                record.let_go(other, "the run is finishing")
            self._let_go_newcomers_after(outcome.generation)
        self.end_if_done()

    def keep_value(self, messages: Iterable[m.Message]) -> None:
        """Rank 0's value from a return that came in the batch that ended the run (failed as uneven before it)."""
        for msg in messages:
            outcome = msg.outcome if isinstance(msg, m.WorkerExited) else None
            if isinstance(outcome, Finished) and outcome.rank == 0 and not self.returned:
                self.return_value, self.checkpoint_error, self.returned = outcome.value, outcome.checkpoint_error, True

    def _let_go_newcomers_after(self, generation: int | None) -> None:
        """Stop the members admitted after `generation`, the one the returning worker trained in last.

        A generation admitting newcomers can be published just as the ranks
        of the one before take their last step: they agree at that check that
        nothing changed, return from train_fn, and never join the new ring.
        The newcomers would wait in it for them until the ring's timeout and
        then fail the run as an uneven finish. They hold nothing of the run
        (they were to receive the state in the ring that never formed), so
        they are let go and the run ends with the ranks that trained. A member
        of `generation` itself is never let go: it is finishing too, and its
        value may be the run's.
        """
        if generation is None:
            return
        roster = self.record.roster
        for worker_id in self.generations.plan:
            rec = roster.get(worker_id)
            if rec is not None and rec.status in IN_RING and rec.admitted_in > generation:
                self.record.let_go(rec, f"admitted after generation {generation}, whose ranks returned")

    def end_if_done(self) -> None:
        """Once a worker returned and no member still trains, the run is done."""
        if self.active and not self.record.roster.count(*IN_RING):
            self.record.done(
                f"a worker returned from train_fn and every member of generation {self.generations.generation} ended"
            )

    def rank0_lost(self, rank0: WorkerRecord, reason: str) -> bool:
        """Rank 0 was lost after a peer returned: the run's result is gone, so it fails (True)."""
        if not self.active or self.returned:
            return False
        plan, roster = self.generations.plan, self.record.roster
        done = ", ".join(f"rank {plan.rank(w)} ({w})" for w in plan if roster[w].status is WorkerStatus.FINISHED)
        self.record.fail(
            f"rank 0 (worker {rank0.worker_id} on node {rank0.host[:8]}) was lost after {done} returned from "
            f"train_fn: {reason}. train_fn's return value on rank 0, the run's result, is lost with it; no other "
            "rank can train on to give it (they have returned)"
        )
        return True

    def fail_uneven(self, worker_id: str, reason: str) -> None:
        """A rank's ring broke after another rank returned from train_fn: the ranks did not finish together."""
        plan, roster = self.generations.plan, self.record.roster
        done = [f"rank {plan.rank(w)} ({w})" for w in plan if roster[w].status is WorkerStatus.FINISHED]
        running = [f"rank {plan.rank(w)} ({w})" for w in plan if roster[w].status in IN_RING]
        self.record.fail(
            f"{', '.join(done)} returned from train_fn while {', '.join(running) or 'others'} still ran collectives "
            f"with it (worker {worker_id}: {reason}). Every rank must leave train_fn at the same step: "
            "give every rank the same number of batches (ElasticSampler pads the epoch to an even split)"
        )
