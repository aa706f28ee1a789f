"""The driver at scale, without Ray: what one batch costs the driver's event loop at 128, 1024 and 8192 workers.

The driver's decisions run on one asyncio loop; while one runs, nothing else
does (no ping answered, no report taken). This times the real `DriverCore`
and the real snapshot (`CallLedger.persist`, its pickling: the part that
holds the loop; the GCS write runs off it) for N workers on N/8 hosts of 8
slots each, with every rank's pace window full (10 summaries each, as after
15 s of training) and rank 0's reports flowing, in the batches a run sends:

- a death: `WorkerDied` of a member, which re-forms the ring (`handle`),
  and the snapshot written after it; beside them, the shell's copy of the
  plan it publishes to the KV actor (`kv_link`: `dict(plan)`, where a
  plan's slots are built once per generation);
- a liveness round where every member answered (`PingResults`): the core's
  handling plus the snapshot the shell decides on, as one batch;
- a pace message (`PacesReported`, one summary): per message, once the
  windows are full (steady state) and while they fill after a reset;
- the straggler policy's judgement over every window (once per interval);
- the loop's busy fraction over `--flow-s` simulated seconds of traffic: every
  rank's pace summary every 1.5 s, rank 0's report batch every 0.25 s, a
  liveness round every `liveness_timeout/3`, a tick every 0.5 s, discovery
  offering the same hosts every second. Messages
  arrive on that schedule; the loop takes what has arrived as one batch and
  spends on it the real time the shell's call handling, `handle` and
  `persist` take; busy is that time over the span.

Each figure is the median (and max) of `--rounds` batches; a death's also
in the process's CPU time (`death_cpu_ms`), which a loaded machine does
not inflate. Prints a table
and writes bench/results/driver_scale.json (or `--out`). Reports, never
asserts. Run it against an older tree with `PYTHONPATH=that/tree` to compare
side by side: the shell's call handling is taken from
`ray_elastic.driver.shell.durability` when it offers it (`MetricSeqs`,
`DurableChanges`), else mirrored from the older driver actor.

    .venv/bin/python bench/driver_scale.py [--workers 128,1024,8192] [--rounds 15] [--flow-s 6]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))
from results_file import write_results  # noqa: E402

from ray_elastic.auth import RunToken  # noqa: E402
from ray_elastic.config import RunConfig  # noqa: E402
from ray_elastic.driver.core import messages as m  # noqa: E402
from ray_elastic.driver.core.driver_core import DriverCore  # noqa: E402
from ray_elastic.driver.core.stragglers import WINDOW  # noqa: E402
from ray_elastic.driver.shell import (
    durability,  # noqa: E402
    snapshot,  # noqa: E402
)
from ray_elastic.driver.shell.durability import CallLedger  # noqa: E402
from ray_elastic.driver.shell.metrics_log import MetricsLog  # noqa: E402
from ray_elastic.protocol import PACE_INTERVAL_S as INTERVAL_S  # noqa: E402
from ray_elastic.protocol import PaceSummary  # noqa: E402

REPORTS_EVERY_S = 0.25  # the metrics shipper's flush
TICK_S = 0.5


class Shell:
    """What the driver actor does around the core for each call: its metrics, its sequence numbers, its snapshot."""

    def __init__(self, core: DriverCore) -> None:
        self.core = core
        self.metrics = MetricsLog("bench")
        self.ledger = CallLedger("bench", RunToken())
        self.new = hasattr(durability, "MetricSeqs")
        self.seqs: Any = durability.MetricSeqs() if self.new else {}
        self.changes: Any = durability.DurableChanges() if self.new else None
        self._sent: dict[str, int] = {}
        self._persisted: tuple[int, int] | None = None  # the reports and sequence numbers the last snapshot holds

    def add_metrics(self, worker_id: str, batch: list, paces: tuple) -> m.Message | None:
        """The body of `DriverActor.add_metrics` before its message is queued."""
        seq = self._sent[worker_id] = self._sent.get(worker_id, 0) + 1
        if self.new:
            if not self.seqs.take(worker_id, seq, bool(batch)):
                return None
        elif not self.seqs.setdefault(worker_id, durability.Seqs()).add(seq):
            return None
        if batch:
            self.metrics.add(batch)
        return m.PacesReported(worker_id, paces) if paces else None

    def rest(self) -> tuple:
        return (self.metrics, self.seqs)

    async def persist(self, batch: list, actions: list) -> None:
        if self.new:
            core_changed = self.changes.seen(batch, actions)
            taken = (len(self.metrics), self.seqs.version)
            rest_changed, self._persisted = taken != self._persisted, taken
            why = await self.ledger.persist(self.core, self.rest(), core_changed, rest_changed)
        else:
            core_changed = bool(actions) or any(not isinstance(x, (m.Tick, m.PacesReported)) for x in batch)
            why = await self.ledger.persist(self.core, self.rest(), core_changed)
        assert why is None, why


class Run:
    """A core with N members formed and synced, driven by batches on a clock."""

    def __init__(self, workers: int) -> None:
        config = RunConfig(min_workers=1, max_workers=workers, resources_per_worker={"CPU": 1.0})
        self.now = 1000.0
        self.core = DriverCore(config, wall_offset=0.0, started_at=self.now)
        self.shell = Shell(self.core)
        self.hosts = {f"{i:040x}": 8 for i in range(workers // 8)}  # node-id-sized host keys
        self.loop = asyncio.new_event_loop()
        spawned = [a.worker_id for a in self.send(m.HostsDiscovered(dict(self.hosts))) if isinstance(a, m.Spawn)]
        self.settle(self.send(*[m.WorkerReady(w) for w in spawned]))
        assert len(self.core.plan) == workers, (len(self.core.plan), self.core.failure)
        self.fill_windows()

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

    def summary(self, index: int = 0) -> PaceSummary:
        """A healthy interval of the current generation (every rank at the same pace: no straggler)."""
        start = self.now + index * INTERVAL_S
        return PaceSummary(self.core.generation, start, start + INTERVAL_S, 50, 50 * 0.025, 50 * 0.005)

    def fill_windows(self) -> None:
        """Every member's window full with the current generation's intervals, as after 15 s of training."""
        members = list(self.core.plan)
        for i in range(0, len(members), 1024):
            # each rank's own objects, as they arrive unpickled from each rank (pickle would share one otherwise)
            self.send(
                *[m.PacesReported(w, tuple(self.summary(j) for j in range(WINDOW))) for w in members[i : i + 1024]]
            )

    def timed(self, *messages: m.Message) -> tuple[float, list[m.Action]]:
        self.now += 0.01
        started, cpu = time.perf_counter(), time.process_time()
        actions = self.core.handle(list(messages), self.now)
        self.cpu_s = time.process_time() - cpu  # the process's CPU time: what a loaded machine does not inflate
        return time.perf_counter() - started, actions

    def persist_s(self, batch: list, actions: list) -> float:
        """Loop time of the shell's `persist` after `batch` (the GCS write stubbed: it runs off the loop)."""
        with mock.patch.object(snapshot, "save", lambda *args: None):
            started = time.perf_counter()
            self.loop.run_until_complete(self.shell.persist(batch, actions))
            return time.perf_counter() - started

    def pace_us(self, count: int) -> list[float]:
        """Per-message cost of `count` single pace messages, from members in turn."""
        members = list(self.core.plan)
        out = []
        for i in range(count):
            spent, _ = self.timed(m.PacesReported(members[(i * 7919) % len(members)], (self.summary(),)))
            out.append(spent)
        return out


def flow(run: Run, seconds: float, liveness_timeout: float = 5.0) -> dict:
    """The loop's busy fraction over `seconds` of simulated traffic, with the real cost of each batch."""
    rng = random.Random(0)
    members = list(run.core.plan)
    rank0 = min(run.core.plan, key=lambda w: run.core.plan[w].rank)
    arrivals: list[tuple[float, int, str, Any]] = []
    n = 0

    def at(t: float, kind: str, what: Any = None) -> None:
        nonlocal n
        n += 1
        heapq.heappush(arrivals, (t, n, kind, what))

    for w in members:
        offset = rng.uniform(0, INTERVAL_S)
        t = offset
        while t < seconds:
            at(t, "pace", w)
            t += INTERVAL_S
    t = 0.0
    while t < seconds:
        at(t, "reports", rank0)
        t += REPORTS_EVERY_S
    t = liveness_timeout / 3
    while t < seconds:
        at(t, "ping")
        t += liveness_timeout / 3
    t = TICK_S
    while t < seconds:
        at(t, "tick")
        t += TICK_S
    t = 1.0  # discovery_interval's default: the same hosts, every second
    while t < seconds:
        at(t, "hosts")
        t += 1.0
    clock, busy, batches, largest = 0.0, 0.0, 0, 0
    base_now = run.now

    async def loop() -> None:
        nonlocal clock, busy, batches, largest
        while arrivals:
            if arrivals[0][0] > clock:
                clock = arrivals[0][0]
            arrived = []  # what Ray hands the actor: made outside the timed part (unpickled in a real driver)
            while arrivals and arrivals[0][0] <= clock:
                t, _, kind, what = heapq.heappop(arrivals)
                if kind == "pace":
                    pace = PaceSummary(run.core.generation, base_now + t - INTERVAL_S, base_now + t, 50, 1.25, 0.25)
                    arrived.append((kind, what, pace))
                elif kind == "reports":
                    arrived.append((kind, what, [(base_now + t, {"loss": 0.5, "step": int(t * 40)})]))
                elif kind == "ping":
                    msg = m.PingResults(answered=frozenset(members), timed_out=frozenset(), sent_at=base_now + t)
                    arrived.append((kind, None, msg))
                elif kind == "hosts":
                    arrived.append((kind, None, m.HostsDiscovered(dict(run.hosts))))
                else:
                    arrived.append((kind, None, m.Tick()))
            started = time.perf_counter()
            batch: list[m.Message] = []
            for kind, who, what in arrived:
                if kind == "pace":
                    msg = run.shell.add_metrics(who, [], (what,))
                elif kind == "reports":
                    msg = run.shell.add_metrics(who, what, ())
                else:
                    msg = what
                if msg is not None:
                    batch.append(msg)
            run.now = base_now + clock
            actions = run.core.handle(batch, run.now)
            await run.shell.persist(batch, actions)
            spent = time.perf_counter() - started
            busy += spent
            clock += spent
            batches += 1
            largest = max(largest, len(batch))

    with mock.patch.object(snapshot, "save", lambda *args: None):
        run.loop.run_until_complete(loop())
    return {"busy_fraction": round(busy / clock, 3), "flow_batches": batches, "flow_largest_batch": largest}


def median_max(values: list[float], scale: float = 1000) -> tuple[float, float]:
    return round(statistics.median(values) * scale, 2), round(max(values) * scale, 2)


def measure(workers: int, rounds: int, flow_s: float) -> dict:
    run = Run(workers)
    deaths, death_cpus, death_snapshots, publishes, pings, ping_batches = [], [], [], [], [], []
    paces_full, paces_filling, judges = [], [], []
    for _ in range(rounds):
        victim = list(run.core.plan)[len(run.core.plan) // 2]
        batch = [m.WorkerDied(victim, "SIGKILL", node_alive=True)]
        spent, actions = run.timed(*batch)
        deaths.append(spent)
        death_cpus.append(run.cpu_s)
        death_snapshots.append(run.persist_s(batch, actions))
        for publish in [a for a in actions if isinstance(a, m.Publish)]:
            started = time.perf_counter()
            dict(publish.plan)
            publishes.append(time.perf_counter() - started)
        run.settle(actions)
        run.now += INTERVAL_S  # the last judgement is an interval old: every message may judge again
        paces_filling.extend(run.pace_us(20))  # the new generation's windows are filling
        run.fill_windows()
        paces_full.extend(run.pace_us(20))
        # the next message after an interval: the policy judges every window
        run.now += INTERVAL_S
        member = next(iter(run.core.plan))
        judges.append(run.timed(m.PacesReported(member, (run.summary(),)))[0])
        batch = [m.PingResults(answered=frozenset(run.core.plan), timed_out=frozenset(), sent_at=run.now)]
        spent, actions = run.timed(*batch)
        pings.append(spent)
        ping_batches.append(spent + run.persist_s(batch, actions))
    # the size the snapshot has now, written whole
    run.persist_s([m.WorkerReady("nobody")], [m.Kill("nobody")])
    blob = len(run.shell.ledger._snapshot or b"")
    # the large parts the GCS holds under keys of their own, written once (none in an older tree)
    parts = sum(len(obj) for _, obj in getattr(run.shell.ledger, "_parts", {}).values())
    row = {
        "workers": workers,
        "hosts": workers // 8,
        "snapshot_kb": round(blob / 1024, 1),
        "snapshot_parts_kb": round(parts / 1024, 1),
    }
    for name, values in [
        ("death_ms", deaths),
        ("death_cpu_ms", death_cpus),
        ("death_snapshot_ms", death_snapshots),
        ("publish_plan_ms", publishes),
        ("ping_round_ms", pings),
        ("ping_batch_ms", ping_batches),
        ("judge_ms", judges),
    ]:
        row[name], row[name.replace("_ms", "_max_ms")] = median_max(values)
    for name, values in [("pace_us", paces_full), ("pace_filling_us", paces_filling)]:
        row[name], row[name.replace("_us", "_max_us")] = median_max(values, 1e6)
    row.update(flow(run, flow_s))
    run.loop.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="128,1024,8192")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--flow-s", type=float, default=6.0, help="simulated seconds of traffic for the busy fraction")
    parser.add_argument("--out", default="driver_scale", help="bench/results/OUT.json")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # a death logs a warning per worker: not what is timed here
    gc.collect()
    gc.freeze()  # as the driver actor does once it started (driver_actor.py)
    rows = [measure(int(n), args.rounds, args.flow_s) for n in args.workers.split(",")]
    cols = ["workers", "death_ms", "death_max_ms", "death_cpu_ms", "death_snapshot_ms", "publish_plan_ms"]
    cols += ["ping_batch_ms", "pace_us"]
    cols += ["pace_filling_us", "judge_ms", "busy_fraction", "snapshot_kb", "snapshot_parts_kb"]
    print(" ".join(f"{c:>17}" for c in cols))
    for row in rows:
        print(" ".join(f"{row[c]:>17}" for c in cols))
    write_results(args.out, rows, rounds=args.rounds, flow_s=args.flow_s)


if __name__ == "__main__":
    main()
