"""The run's share of the autoscaler request, set when the core asks and renewed while it is wanted.

The share lives in Ray's internal KV with an expiry (`autoscale.py`), so a
run that dies without withdrawing it stops asking after `SHARE_TTL_S`; the
live driver renews it every quarter of that. Each write is bounded by
`discovery_timeout`; one that fails is logged and tried again at the next
renewal (a cluster without an autoscaler simply does not grow).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ray_elastic import autoscale

if TYPE_CHECKING:
    from ray_elastic.config import RunConfig

logger = logging.getLogger(__name__)


class AutoscaleShare:
    """How many bundles of `resources_per_worker` this run asks the autoscaler for."""

    def __init__(self, run_id: str, config: RunConfig) -> None:
        self.run_id = run_id
        self.config = config
        self.requested = 0

    async def set(self, count: int) -> None:
        """Ask for `count` bundles (0 withdraws)."""
        self.requested = count
        loop = asyncio.get_running_loop()
        limit = self.config.discovery_timeout
        bundle = dict(self.config.resources_per_worker)
        try:
            await asyncio.wait_for(loop.run_in_executor(None, autoscale.set_share, self.run_id, bundle, count), limit)
        except Exception as e:  # noqa: BLE001 - the next renewal tries again
            logger.warning("could not update the autoscaler request within %g s: %s", limit, e)

    async def renew(self) -> None:
        """Keep the share from expiring while it is wanted."""
        while True:
            await asyncio.sleep(autoscale.SHARE_TTL_S / 4)
            if self.requested:
                await self.set(self.requested)

    def withdraw(self) -> None:
        if self.requested:
            autoscale.withdraw(self.run_id)
