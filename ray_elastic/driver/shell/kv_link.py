"""The driver's link to the run's KV actor: publishing generations, restoring one, and watching it live.

A generation exists once the KV actor took it: the workers' rendezvous
waits on it there. The KV actor is restartable; a restarted one is empty,
so the driver learns of its death at once (a `hold` call pending on it) and
tells the core (`KVRestarted`), which has it told the current generation
again (`RestoreKV`). Every call is bounded by `KV_BACK_S`; one that runs
out ends the run, naming why.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.shell.durability import KV_BACK_S
from ray_elastic.driver.shell.worker_pool import WorkerPool, first_line

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)


class KVLink:
    """Calls to the KV actor, each answered by a message when it fails."""

    def __init__(self, kv: Any, pool: WorkerPool, report: Callable[[Any], None]) -> None:
        self.kv = kv
        self.pool = pool
        self.report = report

    async def publish(self, action: m.Publish) -> None:
        """Hand the generation to the KV actor, then notify the old members that it exists."""
        try:
            # a KV actor restarting meanwhile takes the call when it is back
            await asyncio.wait_for(self.kv.publish.remote(action.generation, dict(action.plan)), KV_BACK_S)
        except Exception as e:  # noqa: BLE001 - a timeout or a dead KV actor: the run cannot form rings
            reason = f"no answer within {KV_BACK_S:g} s" if isinstance(e, asyncio.TimeoutError) else first_line(e)
            self.report(m.PublishFailed(action.generation, reason))
            return
        self.pool.notify(action.notify, action.generation)

    async def restore(self, action: m.RestoreKV) -> None:
        try:
            await asyncio.wait_for(self.kv.restore.remote(action.generation, dict(action.plan)), KV_BACK_S)
        except Exception as e:  # noqa: BLE001 - a timeout or a KV actor dead again
            why = f"no answer within {KV_BACK_S:g} s" if isinstance(e, asyncio.TimeoutError) else first_line(e)
            self.report(m.PublishFailed(action.generation, f"restoring it failed: {why}"))

    async def watch(self, generation: Callable[[], int]) -> None:
        """Learn of the KV actor's death at once, and of its restart by Ray; one not back in `KV_BACK_S` is lost."""
        while True:
            try:
                await self.kv.hold.remote()  # no deadline: it answers only when the actor dies
            except Exception as e:  # noqa: BLE001 - ActorDiedError, ActorUnavailableError and kin
                reason = first_line(e)
            try:
                await asyncio.wait_for(self.kv.current_generation.remote(), KV_BACK_S)
            except Exception as e:  # noqa: BLE001 - gone for good, or not back in time
                why = "no answer" if isinstance(e, asyncio.TimeoutError) else first_line(e)
                self.report(m.KVLost(f"{reason}; not back within {KV_BACK_S:g} s: {why}"))
                return
            logger.warning("the KV actor restarted (%s); restoring generation %d", reason, generation())
            self.report(m.KVRestarted(reason))
