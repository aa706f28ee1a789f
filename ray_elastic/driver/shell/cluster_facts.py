"""What the cluster says, turned into the driver core's messages by tasks beside the loop.

Discovery's hosts and Ray's draining nodes are polled every
`discovery_interval`; the questions that take time (the members' activity
after a broken ring, whether a durable checkpoint exists, which nodes are
alive) run as tasks that answer with a message, so the loop never waits on
them. Each call is bounded: discovery and Ray's tables by
`discovery_timeout`, an activity query by `liveness_timeout`, the
checkpoint lookup by `discovery_timeout` per look and `elastic_timeout` in all.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ray_elastic import ray_private
from ray_elastic.checkpoint import CheckpointStore
from ray_elastic.discovery import DiscoveryError, DiscoveryPoller, alive_ray_nodes, make_discovery
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.shell.replies import read_activity
from ray_elastic.driver.shell.worker_pool import first_line

if TYPE_CHECKING:
    from ray_elastic.config import RunConfig

logger = logging.getLogger(__name__)

CHECKPOINT_RETRY_S = 2.0  # between looks at checkpoint storage that failed

Report = Callable[[Any], None]  # puts a message on the driver's queue


def make_poller(spec: Any, config: RunConfig, resumed: bool) -> DiscoveryPoller:
    """The run's discovery under its failure policy (`DiscoveryPoller`).

    A restarted driver (`resumed`) keeps its predecessor's view of the
    hosts: a discovery failure then is retried within `elastic_timeout`, as
    it was before the restart, instead of failing the run as a failure at
    the run's start does.
    """
    return DiscoveryPoller(
        make_discovery(
            spec,
            config.resources_per_worker,
            config.discovery_timeout,
            keep_cpus=config.kept_cpus,  # CPUs for Ray Data's tasks (datasets=, data_cpus)
        ),
        give_up_after=config.elastic_timeout,
        timeout=config.discovery_timeout,
        last_success=time.monotonic() if resumed else None,
    )


async def poll(poller: DiscoveryPoller) -> dict[str, int] | None:
    # the poller bounds each call by discovery_timeout and applies the retry policy
    return await asyncio.get_running_loop().run_in_executor(None, poller.poll)


async def discovery_loop(poller: DiscoveryPoller, config: RunConfig, report: Report) -> None:
    while True:
        await asyncio.sleep(config.discovery_interval)
        try:
            hosts = await poll(poller)
        except DiscoveryError as e:
            report(m.DiscoveryFailed(str(e)))
            return
        if hosts is not None:
            report(m.HostsDiscovered(hosts))


async def drain_loop(config: RunConfig, report: Report) -> None:
    """Ray's draining nodes (a preemption notice, `ray drain-node`), polled as often as discovery."""
    loop = asyncio.get_running_loop()
    last: dict[str, float] | None = None
    while True:
        try:
            raw = await asyncio.wait_for(
                loop.run_in_executor(None, ray_private.draining_nodes), config.discovery_timeout
            )
        except Exception as e:  # noqa: BLE001 - a GCS hiccup: the next poll tries again
            logger.warning("could not read Ray's draining nodes: %s", e)
        else:
            draining = {node: deadline_ms / 1000 for node, deadline_ms in raw.items()}
            if draining != last:
                report(m.NodesDraining(draining))
                last = draining
        await asyncio.sleep(config.discovery_interval)


async def alive_nodes(config: RunConfig) -> set[str] | None:
    """The alive nodes' ids, or None if Ray's node table cannot be read (then every node counts as alive)."""
    loop = asyncio.get_running_loop()
    try:
        nodes = await asyncio.wait_for(loop.run_in_executor(None, alive_ray_nodes), config.discovery_timeout)
    except Exception as e:  # noqa: BLE001 - unknown: the hosts cool down as if their nodes were alive
        logger.warning("could not read Ray's node table within %g s: %s", config.discovery_timeout, e)
        return None
    return {n.node_id for n in nodes}


async def query_activity(action: m.QueryActivity, handles: dict[str, Any], config: RunConfig, report: Report) -> None:
    """One query per member: its answer proves it alive and tells whether it is inside a collective."""
    ids = [w for w in action.worker_ids if w in handles]
    results = await asyncio.gather(
        *[asyncio.wait_for(handles[w].activity.remote(), config.liveness_timeout) for w in ids],
        return_exceptions=True,
    )
    activity = {w: read_activity(w, result) for w, result in zip(ids, results, strict=True)}
    report(m.ActivityReport(action.generation, action.requester, action.reason, activity))


async def look_for_checkpoint(config: RunConfig, report: Report) -> None:
    """Whether the durable checkpoint exists; storage that fails is asked again until `elastic_timeout`.

    Each look is bounded by `discovery_timeout`. Storage that still fails
    at the deadline is reported as such (`CheckpointFound.error`), never
    as a checkpoint that does not exist.
    """
    url = config.checkpoint_dir
    if url is None:  # the core asks only with checkpoint_dir set; without one there is no durable checkpoint
        report(m.CheckpointFound(False))
        return
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + config.elastic_timeout
    while True:
        try:
            exists = await asyncio.wait_for(
                loop.run_in_executor(None, lambda: CheckpointStore(url).exists()), config.discovery_timeout
            )
        except Exception as e:  # noqa: BLE001 - storage errors of any kind: asked again, then reported
            why = (
                f"no answer within {config.discovery_timeout:g} s"
                if isinstance(e, asyncio.TimeoutError)
                else f"{type(e).__name__}: {first_line(e)}"
            )
            left = deadline - time.monotonic()
            if left <= 0:
                report(m.CheckpointFound(False, error=why))
                return
            logger.warning("cannot look for a checkpoint in %s (%s); asking again", url, why)
            await asyncio.sleep(min(CHECKPOINT_RETRY_S, left))
        else:
            report(m.CheckpointFound(exists))
            return
