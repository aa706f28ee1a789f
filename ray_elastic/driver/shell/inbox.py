"""The driver's inbox: one queue of everything that happens, taken by the loop as batches.

Workers' calls, watchers' deaths and exits, discovery, liveness rounds and
the answers of background queries all land here as messages. The loop takes
what is queued as one batch (waiting up to a tick for the first), so the
core re-plans once for things that happen together. A batch with deaths
asks Ray's node table once (bounded by `discovery_timeout`): each death is
completed by whether its node is alive, and deaths queued meanwhile (a
node's workers die together) join the batch.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.shell import cluster_facts
from ray_elastic.driver.shell.worker_pool import Died

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.config import RunConfig
    from ray_elastic.driver.shell.durability import CallLedger

TICK_S = 0.5


class Inbox:
    """The queue, and the batches taken from it."""

    def __init__(self, config: RunConfig, ledger: CallLedger, host_of: Callable[[str], str | None]) -> None:
        self.config = config
        self.ledger = ledger
        self.host_of = host_of
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, message: Any) -> None:
        self.queue.put_nowait(message)

    def drain(self) -> list[Any]:
        items = []
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    async def next_batch(self) -> list[m.Message]:
        """What is queued now (waiting up to a tick for the first), with deaths completed by their node's fate."""
        try:
            raw = [await asyncio.wait_for(self.queue.get(), TICK_S)]
        except asyncio.TimeoutError:
            return []
        raw.extend(self.drain())
        if not any(isinstance(x, Died) for x in raw):
            return self.ledger.unwrap(raw)
        alive = await cluster_facts.alive_nodes(self.config)
        raw = self.ledger.unwrap(raw + self.drain())
        return [
            m.WorkerDied(x.worker_id, x.reason, alive is None or self.host_of(x.worker_id) in alive)
            if isinstance(x, Died)
            else x
            for x in raw
        ]
