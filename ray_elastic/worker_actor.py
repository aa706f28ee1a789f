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
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from typing import Any

import ray

from ray_elastic.config import WorkerConfig
from ray_elastic.exceptions import CoordinatorDiedError, WorkerRemovedError
from ray_elastic.payload import unpack
from ray_elastic.protocol import CoordinatorLost, Finished, Removed, UserError, WorkerOutcome
from ray_elastic.worker_context import WorkerContext, set_current

logger = logging.getLogger(__name__)


class WorkerActor:
    """Wrapped by `ray.remote` with a `control` concurrency group (see `actor_class`)."""

    def __init__(
        self,
        worker_id: str,
        kv: ray.actor.ActorHandle,
        driver: ray.actor.ActorHandle,
        settings: WorkerConfig,
    ) -> None:
        self.worker_id = worker_id
        self.ctx = WorkerContext(worker_id, kv, driver, settings)
        set_current(self.ctx)

    def run(self, payload: bytes) -> WorkerOutcome:
        try:
            train_fn, config = unpack(payload)
            value = train_fn(config)
            rank = self.ctx.slot.rank if self.ctx.slot is not None else None
            if rank == 0:
                note = self.ctx.flush_checkpoint()
                if note is not None:  # the result still goes back: a storage blip must not lose it
                    logger.warning("train_fn finished, but the last durable checkpoint was not written: %s", note)
            return Finished(rank, value if rank == 0 else None)
        except WorkerRemovedError:
            return Removed()
        except CoordinatorDiedError as e:
            return CoordinatorLost(str(e))
        except BaseException as e:  # noqa: BLE001 - every user failure is reported, with its traceback
            return UserError(f"{type(e).__name__}: {e}", traceback.format_exc())
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
    def activity(self) -> dict[str, Any]:
        """Seconds since this worker last entered or left a collective, and whether it is in one."""
        return {"idle_s": time.time() - self.ctx.last_activity, "in_collective": self.ctx.in_collective}

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()


def actor_class() -> Any:
    """`WorkerActor` as a Ray actor class with its control thread group."""
    return ray.remote(
        max_restarts=0,
        concurrency_groups={"control": 2},
    )(WorkerActor)
