"""Liveness rounds: every live worker pinged, and the CPU time of those that did not answer read on their node.

A worker that did not answer in time is judged (by the core) on its CPU
time, read by its node's `ProcessProbe` (`cpu_probe.py`); when that probe did
not answer the same round either, its node is unreachable (cut off, or lost
without a word) and there is nothing to wait for. So a silent node costs at
most one round: a third of `liveness_timeout` plus `liveness_timeout`.
Every ping and every reading is bounded by `liveness_timeout`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic import ray_private
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.shell.cpu_probe import start_probe
from ray_elastic.driver.shell.replies import read_pings
from ray_elastic.driver.shell.worker_pool import WorkerPool, first_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.config import RunConfig


class LivenessRounds:
    """The rounds of pings, and one probe per node with a worker on it (started when first needed).

    Args:
        config: `liveness_timeout` sets the round and every wait in it.
        pool: the workers' handles and process ids.
        alive_hosts: the live workers' ids and their hosts, as the core has them now.
        report: puts the round's `PingResults` on the driver's queue.
    """

    def __init__(
        self,
        config: RunConfig,
        pool: WorkerPool,
        alive_hosts: Callable[[], dict[str, str]],
        report: Callable[[Any], None],
    ) -> None:
        self.config = config
        self.pool = pool
        self.alive_hosts = alive_hosts
        self.report = report
        self.probes: dict[str, Any] = {}  # node -> its ProcessProbe

    async def run(self) -> None:
        """Ping every live worker, and the probe of each node they run on, each round."""
        interval = max(0.2, self.config.liveness_timeout / 3)
        while True:
            await asyncio.sleep(interval)
            hosts = {w: h for w, h in self.alive_hosts().items() if w in self.pool.handles}
            ids = list(hosts)
            nodes = sorted(set(hosts.values()))
            for node in set(self.probes) - set(nodes):  # no worker there any more (its node may be gone)
                self.kill_probe(node)
            for node in nodes:
                if node not in self.probes:
                    self.probes[node] = start_probe(node)
            sent_at = time.monotonic()
            timeout = self.config.liveness_timeout
            answers = await asyncio.gather(
                *[asyncio.wait_for(self._ping(w), timeout) for w in ids],
                *[asyncio.wait_for(self.probes[n].ping.remote(), timeout) for n in nodes],
                return_exceptions=True,
            )
            results = dict(zip(ids, answers[: len(ids)], strict=True))
            silent_nodes = set()
            for node, answer in zip(nodes, answers[len(ids) :], strict=True):
                if isinstance(answer, asyncio.TimeoutError):
                    silent_nodes.add(node)
                elif isinstance(answer, BaseException):  # the probe died: a fresh one reads CPU time if needed
                    self.kill_probe(node)
            answered, timed_out = read_pings(results)
            samples = await self._read_cpu(timed_out, hosts, silent_nodes) if timed_out else {}
            self.report(m.PingResults(answered=answered, timed_out=timed_out, sent_at=sent_at, samples=samples))

    async def _ping(self, worker_id: str) -> None:
        """A ping; a worker's first asks for its pid instead (it answers the same way), to read its CPU time later."""
        handle = self.pool.handles[worker_id]
        if worker_id in self.pool.pids:
            await handle.ping.remote()
        else:
            self.pool.pids[worker_id] = await handle.pid.remote()

    async def _read_cpu(
        self, worker_ids: frozenset[str], hosts: dict[str, str], silent_nodes: set[str]
    ) -> dict[str, m.CpuSample | str]:
        """Each worker's CPU use over a short window, read by its node's `ProcessProbe`, or why there is none.

        One call per node, under `liveness_timeout` in all (the probe's start
        included): a node cut off silently gives no reading, and its workers
        are then killed as hung.
        """
        limit = self.config.liveness_timeout
        window = min(0.5, limit / 4)
        pids = self.pool.pids
        unknown = [w for w in worker_ids if w not in pids and w in self.pool.handles]
        if unknown:
            await self._pids_from_gcs(unknown, limit)
        by_node: dict[str, list[str]] = {}
        samples: dict[str, m.CpuSample | str] = {}
        for worker_id in worker_ids:
            host = hosts.get(worker_id)
            if worker_id not in pids or host is None:
                samples[worker_id] = "its process id is not known yet"
            elif host in silent_nodes:
                samples[worker_id] = f"its node did not answer within {limit:g} s either"
            else:
                by_node.setdefault(host, []).append(worker_id)

        async def read(node: str, ids: list[str]) -> None:
            if node not in self.probes:
                self.probes[node] = start_probe(node)
            try:
                by_pid = await asyncio.wait_for(self.probes[node].sample.remote([pids[w] for w in ids], window), limit)
            except Exception as e:  # noqa: BLE001 - no answer, or the probe died (with its node, maybe)
                if isinstance(e, asyncio.TimeoutError):
                    why = f"no reading within {limit:g} s (its node may be unreachable)"
                else:
                    why = f"the reading failed: {first_line(e)}"
                    self.kill_probe(node)  # the next reading starts a fresh one
                samples.update({w: why for w in ids})
                return
            samples.update({w: by_pid[pids[w]] for w in ids})

        await asyncio.gather(*[read(node, ids) for node, ids in by_node.items()])
        return samples

    async def _pids_from_gcs(self, worker_ids: list[str], limit: float) -> None:
        """The process ids of workers that never answered a ping, from the GCS's actor table.

        A newcomer stopped or frozen before its first answer (the first ping
        asks for the pid) would otherwise give no reading, and be bounded only
        by its boot deadline (`elastic_timeout`, minutes): a hot spare or a
        newcomer hung in its boot must be found in a round. Ray records a pid
        once the actor's constructor has run (state ALIVE); before that (a
        runtime env, a process still starting) there is nothing to read, and
        the boot deadline bounds it.
        """
        handles = {w: self.pool.handles[w] for w in worker_ids}

        def look() -> dict[str, int]:
            found = {}
            for worker_id, handle in handles.items():
                try:
                    record = ray_private.actor_record(ray_private.actor_id_of(handle.handle))
                except Exception:  # noqa: BLE001 - a GCS hiccup: no reading this round
                    continue
                if record.get("State") == "ALIVE" and record.get("Pid"):
                    found[worker_id] = int(record["Pid"])
            return found

        loop = asyncio.get_running_loop()
        try:
            found = await asyncio.wait_for(loop.run_in_executor(None, look), limit)
        except asyncio.TimeoutError:
            return
        for worker_id, pid in found.items():
            self.pool.pids.setdefault(worker_id, pid)

    def kill_probe(self, node: str) -> None:
        probe = self.probes.pop(node, None)
        if probe is not None:
            try:
                ray.kill(probe, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass

    def close(self) -> None:
        for node in list(self.probes):
            self.kill_probe(node)
