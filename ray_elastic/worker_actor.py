"""The worker actor: one per slot, running the user's `train_fn(config)`.

`run()` occupies the actor's default thread for the whole training; the
driver reaches the worker meanwhile through a separate `control` thread
group (`notify` pushes a host-change notice into memory, `ping` answers the
liveness check). `run()` never raises for the expected endings: it returns an
outcome (`protocol.WorkerOutcome`): `Finished` (with rank 0's return value),
`Removed` (left out of a new generation) or `UserError` (the user's exception,
with its traceback), so the
driver can tell a user error from a death, which Ray reports as an actor
error on the pending call.

A worker is a detached actor: it outlives a driver that Ray restarts. The
restarted driver calls `run()` again; that call waits behind the first (the
default group runs one call at a time) and returns its outcome, or starts
training if the first never came. A watchdog thread ends the run's
leftovers (its actors, placement groups and snapshot) when the driver is
dead for good: Ray kills the driver with `fit()`'s caller, and detached
workers would otherwise outlive both.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import ray
from ray import cloudpickle

from ray_elastic import ray_private
from ray_elastic.auth import with_token_check
from ray_elastic.exceptions import (
    REPEATING,
    CoordinatorDiedError,
    WorkerRemovedError,
    describe_exception,
    format_traceback,
)
from ray_elastic.protocol import CoordinatorLost, Finished, Removed, UserError, WorkerConfig, WorkerOutcome
from ray_elastic.run_footprint import run_namespace
from ray_elastic.runtime.allocator import tune_allocator
from ray_elastic.runtime.context import WorkerContext
from ray_elastic.runtime.process import set_current
from ray_elastic.runtime.threads import apply_threads
from ray_elastic.session_log import keep_in_session_log
from ray_elastic.shipping import unpack

logger = logging.getLogger(__name__)

_WATCH_S = 5.0  # how often a worker asks whether the run's driver is still there
_WATCH_MISSES = 2  # answers "dead for good" in a row before the worker removes the run


class WorkerActor:
    """Wrapped by `ray.remote` with a `control` concurrency group (see `actor_class`)."""

    def __init__(
        self,
        worker_id: str,
        kv: Any,
        driver: Any,
        settings: WorkerConfig,
    ) -> None:
        entered = time.time()  # the boot's first mark (runtime/boot_marks.py), kept once the context exists
        keep_in_session_log(f"worker-{settings.run_id}-{worker_id}")  # its lines in Ray's logs (logs.py)
        tune_allocator()  # before train_fn allocates: a step's freed blocks stay in the heap (see allocator.py)
        apply_threads(settings.cpus, settings.omp_threads_set)  # before train_fn imports torch
        self.worker_id = worker_id
        self.ctx = WorkerContext(worker_id, kv, driver, settings)
        self.ctx.boot_marks.mark("actor_entered", entered)
        self.ctx.run_token = getattr(self, "_run_token", None)  # for the run's other actors (the feed)
        set_current(self.ctx)
        self._outcome: WorkerOutcome | None = None
        self._run_id = settings.run_id
        driver_id = ray_private.actor_id_of(driver.handle) if hasattr(driver, "handle") else None
        if driver_id is not None:
            threading.Thread(
                target=self._watch_driver, args=(driver_id,), name="ray-elastic-orphan-watch", daemon=True
            ).start()
        self.ctx.boot_marks.mark("actor_left")

    def run(self, payload: bytes) -> WorkerOutcome:
        """Train; a second call (from a restarted driver) returns the first one's outcome."""
        if self._outcome is None:
            self._outcome = self._train(payload)
        return self._outcome

    def _watch_driver(self, driver_id: str) -> None:
        """Remove the run when its driver is dead for good (not restarting): `fit()`'s caller is gone."""
        misses = 0
        while True:
            time.sleep(_WATCH_S)
            try:
                state = ray_private.actor_state(driver_id)
            except Exception:  # noqa: BLE001 - a GCS hiccup is no verdict
                continue
            misses = misses + 1 if state == "DEAD" else 0
            if misses >= _WATCH_MISSES:
                break
        logger.error("worker %s: the run's driver is dead for good; removing the run's actors", self.worker_id)
        from ray_elastic.teardown import remove_run  # here: it brings Ray's autoscaler SDK, which a boot need not load

        # the run's placement groups take this worker with them: it exits here only if they were gone already
        remove_run(self._run_id, run_namespace(self._run_id), f"worker {self.worker_id}")
        os._exit(0)

    def _train(self, payload: bytes) -> WorkerOutcome:
        marks = self.ctx.boot_marks
        try:
            marks.mark("run_entered")
            train_fn, config = unpack(payload)
            marks.mark("unpacked")
            value = train_fn(config)
            if self.ctx.slot is None:
                return UserError(_NEVER_JOINED, "", retryable=False)
            rank, generation = self.ctx.slot.rank, self.ctx.generation
            if rank != 0:
                return Finished(rank, generation=generation)
            note = self.ctx.flush_checkpoint()
            if note is not None:  # the result still goes back: a storage blip must not lose it
                logger.warning("train_fn finished, but the last durable checkpoint was not written: %s", note)
            blob, unpicklable = _pickled(value)
            if unpicklable is not None:
                return UserError(unpicklable, "", retryable=False)
            return Finished(rank, blob, checkpoint_error=note, generation=generation)
        except WorkerRemovedError:
            return Removed()
        except CoordinatorDiedError as e:
            return CoordinatorLost(describe_exception(e))
        # running again meets the same mistake again: never retried
        except REPEATING as e:
            return UserError(describe_exception(e), format_traceback(e), retryable=False)
        except BaseException as e:  # noqa: BLE001 - every user failure is reported, with its traceback
            return UserError(describe_exception(e), format_traceback(e))
        finally:
            try:
                self.ctx.shutdown()
            except Exception:  # noqa: BLE001 - a dead driver cannot take the last metrics
                logger.warning("worker %s could not deliver its last metrics", self.worker_id)

    @ray.method(concurrency_group="control")
    def ping(self) -> float:
        return time.time()

    @ray.method(concurrency_group="control")
    def notify(self, generation: int) -> None:
        self.ctx.notify(generation)

    @ray.method(concurrency_group="control")
    def abandon(self, generation: int, reason: str) -> None:
        """The driver lost a member of `generation`: leave its ring now, even from inside a collective."""
        self.ctx.abandon(generation, reason)

    @ray.method(concurrency_group="control")
    def activity(self) -> dict[str, Any]:
        """Seconds since this worker last entered or left a collective, and whether it is in one."""
        return {"idle_s": time.time() - self.ctx.last_activity, "in_collective": self.ctx.in_collective}

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()


_NEVER_JOINED = (
    "train_fn returned without joining the ring: no function decorated with @ray_elastic.run was called "
    "and no collective was used, so this worker had no rank and its return value and report() metrics "
    "had nowhere to go. Wrap the training loop in an @ray_elastic.run function called from train_fn."
)


def _pickled(value: Any) -> tuple[bytes | None, str | None]:
    """`(value pickled, None)`, or `(None, a user error saying why it cannot be pickled)`.

    Pickled here, once, rather than by Ray on the way back: a failure is then
    the user's clear error, not the actor's death (which would be taken for a
    fault of rank 0's node). `fit()` unpickles it.
    """
    try:
        return cloudpickle.dumps(value), None
    except Exception as e:  # noqa: BLE001 - pickling may raise anything
        return None, (
            f"train_fn's return value on rank 0 ({type(value).__name__}) cannot be pickled, so it cannot go back "
            f"to fit(): {describe_exception(e)}. Return something picklable (e.g. a state_dict, numbers, "
            "paths); training itself finished"
        )


def actor_class() -> Any:
    """`WorkerActor` as a Ray actor class with its control thread group, taking the run's token first."""
    return ray.remote(
        max_restarts=0,
        concurrency_groups={"control": 2},
    )(with_token_check(WorkerActor))
