"""The driver at scale, without Ray: what one batch costs the driver's event loop at 128, 1024 and 8192 workers.

The driver's decisions run on one asyncio loop; while one runs, nothing else
does (no ping answered, no report taken). This times the real `DriverCore`
and the real snapshot (`CallLedger.persist`, its pickling: the part that
holds the loop; the GCS write runs off it) for N workers on N/8 hosts of 8
slots each, in the batches a run sends:

- a death: `WorkerDied` of a member, which re-forms the ring (`handle`);
- the snapshot written after it;
- a liveness round: `PingResults` with every member answering;
- an idle tick (`Tick`), and an empty batch (rank 0's metrics, which carry
  no message for the core);
- the snapshot after a liveness round.

Each figure is the median (and max) of `--rounds` batches. A cost that grows
faster than N (quadratic) shows as a per-worker cost that grows with N; the
last column prints it for deaths. Prints a table and writes
bench/results/driver_scale.json. Reports, never asserts.

    .venv/bin/python bench/driver_scale.py [--workers 128,1024,8192] [--rounds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
from results_file import write_results  # noqa: E402

from ray_elastic.auth import RunToken  # noqa: E402
from ray_elastic.config import RunConfig  # noqa: E402
from ray_elastic.driver import messages as m  # noqa: E402
from ray_elastic.driver import snapshot  # noqa: E402
from ray_elastic.driver.core import DriverCore  # noqa: E402
from ray_elastic.driver.durability import CallLedger  # noqa: E402
from ray_elastic.driver.metrics_log import MetricsLog  # noqa: E402


class Run:
    """A core with N members formed and synced, driven by batches on a clock."""

    def __init__(self, workers: int) -> None:
        config = RunConfig(min_workers=1, max_workers=workers, resources_per_worker={"CPU": 1.0})
        self.now = 1000.0
        self.core = DriverCore(config, wall_offset=0.0, started_at=self.now)
        self.hosts = {f"{i:040x}": 8 for i in range(workers // 8)}  # node-id-sized host keys
        self.ledger = CallLedger("bench", RunToken())
        self.metrics = MetricsLog("bench")
        spawned = [a.worker_id for a in self.send(m.HostsDiscovered(dict(self.hosts))) if isinstance(a, m.Spawn)]
        self.settle(self.send(*[m.WorkerReady(w) for w in spawned]))
        assert len(self.core.plan) == workers, (len(self.core.plan), self.core.failure)

    def send(self, *messages: m.Message) -> list[m.Action]:
        self.now += 0.01
        return self.core.handle(list(messages), self.now)

    def settle(self, actions: list[m.Action]) -> None:
        """Every rank of each published generation syncs, and replacements boot."""
        for _ in range(5):
            for publish in [a for a in actions if isinstance(a, m.Publish)]:
                self.send(*[m.WorkerSynced(w, publish.generation, self.now) for w in publish.plan])
            spawned = [a.worker_id for a in actions if isinstance(a, m.Spawn)]
            if not spawned:
                return
            actions = self.send(*[m.WorkerReady(w) for w in spawned])

    def timed(self, *messages: m.Message) -> tuple[float, list[m.Action]]:
        self.now += 0.01
        started = time.perf_counter()
        actions = self.core.handle(list(messages), self.now)
        return time.perf_counter() - started, actions

    def snapshot_s(self, core_changed: bool = True) -> float:
        """Loop time of one `persist` (the GCS write stubbed: it runs off the loop)."""

        async def persist() -> float:
            started = time.perf_counter()
            why = await self.ledger.persist(self.core, (self.metrics, {}), core_changed)
            assert why is None, why
            return time.perf_counter() - started

        with mock.patch.object(snapshot, "save", lambda *args: None):
            return asyncio.run(persist())


def median_max(values: list[float]) -> tuple[float, float]:
    return round(statistics.median(values) * 1000, 2), round(max(values) * 1000, 2)


def measure(workers: int, rounds: int) -> dict:
    run = Run(workers)
    deaths, death_snapshots, pings, ping_snapshots, ticks, empties = [], [], [], [], [], []
    for _ in range(rounds):
        victim = list(run.core.plan)[len(run.core.plan) // 2]
        spent, actions = run.timed(m.WorkerDied(victim, "SIGKILL", node_alive=True))
        deaths.append(spent)
        death_snapshots.append(run.snapshot_s())
        run.settle(actions)
        answered = frozenset(run.core.plan)
        spent, _ = run.timed(m.PingResults(answered=answered, timed_out=frozenset(), sent_at=run.now, samples={}))
        pings.append(spent)
        ping_snapshots.append(run.snapshot_s())
        ticks.append(run.timed(m.Tick())[0])
        empties.append(run.timed()[0])
    blob = len(run.ledger._snapshot or b"")
    row = {"workers": workers, "hosts": workers // 8, "snapshot_kb": round(blob / 1024, 1)}
    for name, values in [
        ("death_ms", deaths),
        ("death_snapshot_ms", death_snapshots),
        ("ping_round_ms", pings),
        ("ping_snapshot_ms", ping_snapshots),
        ("tick_ms", ticks),
        ("empty_batch_ms", empties),
    ]:
        row[name], row[name.replace("_ms", "_max_ms")] = median_max(values)
    row["death_us_per_worker"] = round(row["death_ms"] * 1000 / workers, 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="128,1024,8192")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # a death logs a warning per worker: not what is timed here
    gc.collect()
    gc.freeze()  # as the driver actor does once it started (driver_actor.py)
    rows = [measure(int(n), args.rounds) for n in args.workers.split(",")]
    cols = ["workers", "death_ms", "death_max_ms", "death_snapshot_ms", "ping_round_ms", "ping_snapshot_ms"]
    cols += ["tick_ms", "empty_batch_ms", "snapshot_kb", "death_us_per_worker"]
    print(" ".join(f"{c:>18}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>18}" for c in cols))
    write_results("driver_scale", rows, rounds=args.rounds)


if __name__ == "__main__":
    main()
