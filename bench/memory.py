"""Memory: the driver actor's RSS at N simulated ranks, and a worker actor's overhead over bare torch.

1. Driver at scale. The driver's real core (`DriverCore`) is built inside a
   Ray actor process (the kind of process the driver runs in), discovers N/8
   hosts of 8 slots, sees N workers ready and publishes one generation of N
   ranks (rank assignment, the plan, the events), and its metrics log takes
   `--metric-steps` reported metrics. No worker actors or placement
   groups are started (N processes do not fit on 2 cores): what is measured
   is the driver's own bookkeeping for N ranks, on top of its process. RSS is
   read with psutil before the object exists (the process with ray_elastic
   imported) and after.
2. Driver under churn (`--churn N`, no Ray). The real core goes through N
   membership changes on 8 one-slot hosts: each change kills rank 0 (every
   other one with its node, replaced by a new node), the next generation
   syncs, the replacement boots and is admitted. Every N/10 changes it
   records the process's RSS, the core's records, its snapshot's size and
   pickling time, and the microseconds one change cost: a week-long run
   with churn must keep all of them flat.
3. Worker overhead. A 2-worker `ElasticTrainer` on a local Ray trains a small
   MLP for a few steps (so each worker has joined a Gloo ring, synced and
   committed) and reads its own RSS. Beside it, with the same model and the
   same steps: a bare `python -c` process that imports torch (no Ray), and a
   plain Ray actor that imports torch (Ray's own share of a worker process).

Prints a table and writes bench/results/memory.json (memory_churn.json for
`--churn-only`). Reports, never asserts.

    .venv/bin/python bench/memory.py [--ranks 1024]
    .venv/bin/python bench/memory.py --churn-only --churn 100000
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import pickle
import subprocess
import sys
import time
import uuid

import psutil
import ray
from results_file import write_results

MB = 2**20
STEPS = 20

# the same work in every process measured for the worker overhead: a small MLP, a few SGD steps
WORK = """
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range({steps}):
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / MB


@ray.remote(num_cpus=0)
class DriverHost:
    """A Ray actor process that holds a driver core for N simulated ranks."""

    def measure(self, ranks: int, metric_steps: int) -> dict:
        from ray_elastic.config import RunConfig
        from ray_elastic.driver.core import messages as m
        from ray_elastic.driver.core.driver_core import DriverCore
        from ray_elastic.driver.shell.metrics_log import MetricsLog

        base = rss_mb()
        config = RunConfig(min_workers=1, max_workers=ranks, resources_per_worker={"CPU": 1.0})
        core = DriverCore(config, wall_offset=time.time() - time.monotonic(), started_at=time.monotonic())
        hosts = {f"{i:040x}": 8 for i in range((ranks + 7) // 8)}  # node-id-sized host keys, 8 slots each
        spawned = core.handle([m.HostsDiscovered(hosts)], time.monotonic())
        actions = core.handle([m.WorkerReady(a.worker_id) for a in spawned if isinstance(a, m.Spawn)], time.monotonic())
        [publish] = [a for a in actions if isinstance(a, m.Publish)]
        after_publish = rss_mb()
        log = MetricsLog(f"bench-mem-{uuid.uuid4().hex[:8]}", capacity=max(metric_steps, 1))
        for step in range(metric_steps):
            log.add([(time.time(), {"step": step, "loss": 0.5, "world_size": ranks})])
        after_metrics = rss_mb()
        return {
            "ranks": ranks,
            "process_rss_mb": base,
            "driver_rss_mb": after_publish,
            "driver_state_mb": after_publish - base,
            "rss_with_metrics_mb": after_metrics,
            "metric_steps": metric_steps,
            "generation": publish.generation,
            "plan_size": len(publish.plan),
        }


@ray.remote(num_cpus=0)
class LongRunHost:
    """A fresh process that takes N reports the way a long run does, bounded as ray-elastic holds them, or all."""

    def measure(self, reports: int, bounded: bool) -> dict:
        from ray_elastic.driver.shell.metrics_log import MetricsLog
        from ray_elastic.trainer.driver_watch import Reports

        base = rss_mb()
        log = MetricsLog("bench-long-run")
        caller = Reports(keep=100_000 if bounded else None)
        held: list = []  # the unbounded way: every report kept by the driver and by the caller
        batch_size, fetch_every = 25, 2_000  # rank 0 ships ~4 batches/s; fit() polls twice a second
        for start in range(0, reports, batch_size):
            batch = [
                (float(i), {"step": i, "loss": 0.5, "epoch": i // 10_000}) for i in range(start, start + batch_size)
            ]
            if bounded:
                log.add(batch)
                if start % fetch_every == 0:
                    caller.take(*log.fetch(caller.seen))
            else:
                held.extend(batch)
                caller.take(start, batch)
        if bounded:
            caller.take(*log.fetch(caller.seen))
        return {"reports": reports, "bounded": bounded, "rss_growth_mb": rss_mb() - base, "kept": len(caller.kept)}


class Churn:
    """A driver core on 8 one-slot hosts, taken through membership changes as a run with churn would."""

    def __init__(self) -> None:
        from ray_elastic.config import RunConfig
        from ray_elastic.driver.core import messages as m
        from ray_elastic.driver.core.driver_core import DriverCore

        self.m = m
        config = RunConfig(min_workers=1, max_workers=8, resources_per_worker={"CPU": 1.0}, cooldown_range=(0, 0))
        self.now = 1000.0
        self.core = DriverCore(config, wall_offset=0.0, started_at=self.now)
        self.hosts = {f"{i:040x}": 1 for i in range(8)}  # node-id-sized host keys
        self.next_host = len(self.hosts)
        self.whole_again(self.send(m.HostsDiscovered(dict(self.hosts))))

    def send(self, *messages) -> list:
        self.now += 0.01
        return self.core.handle(list(messages), self.now)

    def whole_again(self, actions: list) -> None:
        """Sync every new generation and admit the replacements until 8 ranks train again."""
        m = self.m
        for _ in range(10):
            spawned = [a.worker_id for a in actions if isinstance(a, m.Spawn)]
            for publish in [a for a in actions if isinstance(a, m.Publish)]:
                self.send(*[m.WorkerSynced(w, publish.generation, self.now, publish.generation) for w in publish.plan])
            if len(self.core.plan) == 8 and not spawned and self.core.state.value == "running":
                return
            actions = self.send(*[m.WorkerReady(w) for w in spawned], m.Tick())
        raise RuntimeError(f"the world did not become whole again: {self.core.failure or len(self.core.plan)}")

    def change(self, i: int) -> None:
        m = self.m
        victim = next(iter(self.core.plan))
        if i % 2:  # rank 0's node is lost, a new node is offered
            self.hosts.pop(self.core.workers[victim].host, None)
            self.hosts[f"{self.next_host:040x}"] = 1
            self.next_host += 1
            actions = self.send(
                m.WorkerDied(victim, "node lost", node_alive=False), m.HostsDiscovered(dict(self.hosts))
            )
        else:
            actions = self.send(m.WorkerDied(victim, "SIGKILL", node_alive=True))
        self.whole_again(actions)


def churn(changes: int) -> list[dict]:
    """RSS, records, snapshot and time per change every `changes // 10` changes through the real core."""
    run = Churn()
    gc.collect()
    base = rss_mb()
    rows = []
    every = max(1, changes // 10)
    started = time.perf_counter()
    for i in range(1, changes + 1):
        run.change(i)
        if i % every == 0:
            spent = time.perf_counter() - started
            gc.collect()
            t = time.perf_counter()
            blob = pickle.dumps(run.core, protocol=pickle.HIGHEST_PROTOCOL)
            core = run.core
            rows.append(
                {
                    "changes": i,
                    "generation": core.generation,
                    "rss_growth_mb": round(rss_mb() - base, 2),
                    "us_per_change": round(spent / every * 1e6, 1),
                    "snapshot_kb": round(len(blob) / 1024, 1),
                    "snapshot_pickle_ms": round((time.perf_counter() - t) * 1000, 2),
                    "workers": len(core.workers),
                    "fenced": len(core.fenced),
                    "hosts_seen": len(core.host_first_seen),
                    "events": len(core.events),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            started = time.perf_counter()
    return rows


@ray.remote(num_cpus=1)
class TorchActor:
    """A plain Ray actor doing the same work: Ray's own share of a worker process."""

    def rss_after_work(self) -> float:
        exec(WORK.format(steps=STEPS), {})  # noqa: S102 - our own constant text
        return rss_mb()


def worker_train_fn(config: dict) -> float:
    import torch

    import ray_elastic as elastic

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)

    @elastic.run
    def train(state) -> float:
        while state.step < STEPS:
            x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            if state.step % 10 == 0:
                state.commit()
            else:
                state.check_host_updates()
        return psutil.Process().memory_info().rss / MB

    return train(state)


def bare_torch_rss() -> float:
    code = WORK.format(steps=STEPS) + "\nimport psutil\nprint(psutil.Process().memory_info().rss)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1]) / MB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--metric-steps", type=int, default=10_000, help="reported metrics the driver holds")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of the worker overhead measurement")
    parser.add_argument("--long-run-reports", type=int, default=2_000_000, help="reports of the long-run check")
    parser.add_argument("--churn", type=int, default=100_000, help="membership changes through the driver's core")
    parser.add_argument("--churn-only", action="store_true", help="only the churn measurement (no Ray)")
    args = parser.parse_args()
    if args.churn_only:
        logging.disable(logging.WARNING)  # a line per change otherwise
        write_results("memory_churn", churn(args.churn), changes=args.churn)
        return
    import ray_elastic as elastic

    ray.init(address="local", num_cpus=2, logging_level=logging.ERROR, include_dashboard=False)
    host = DriverHost.remote()
    driver = ray.get(host.measure.remote(args.ranks, args.metric_steps), timeout=300)
    ray.kill(host)
    print(
        f"driver, {driver['ranks']} ranks: process {driver['process_rss_mb']:.0f} MB before the driver object, "
        f"{driver['driver_rss_mb']:.0f} MB with {driver['ranks']} worker records and a published generation "
        f"(+{driver['driver_state_mb']:.1f} MB), {driver['rss_with_metrics_mb']:.0f} MB with "
        f"{driver['metric_steps']} reported metrics",
        flush=True,
    )
    long_run = {}
    for bounded in (True, False):
        host = LongRunHost.remote()
        long_run["bounded" if bounded else "unbounded"] = ray.get(
            host.measure.remote(args.long_run_reports, bounded), timeout=600
        )
        ray.kill(host)
    print(
        f"long run, {args.long_run_reports} reports through driver and caller: "
        f"{long_run['bounded']['rss_growth_mb']:.0f} MB bounded as ray-elastic holds them "
        f"(driver: unfetched only; fit(): newest {long_run['bounded']['kept']}), "
        f"{long_run['unbounded']['rss_growth_mb']:.0f} MB keeping every report (before this change)",
        flush=True,
    )
    rows = []
    for rep in range(args.reps):
        bare = bare_torch_rss()
        actor = TorchActor.remote()
        ray_actor = ray.get(actor.rss_after_work.remote(), timeout=300)
        ray.kill(actor)
        result = elastic.ElasticTrainer(worker_train_fn, 2, 2, verbose=0).fit()
        ours = result.return_value  # rank 0's
        rows.append({"bare_torch_mb": bare, "ray_actor_torch_mb": ray_actor, "elastic_worker_mb": ours})
        print(
            f"rep {rep}: bare python + torch {bare:.0f} MB, Ray actor + torch {ray_actor:.0f} MB, "
            f"ray-elastic worker (in a ring, synced, committed) {ours:.0f} MB",
            flush=True,
        )
    ray.shutdown()
    summary = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}
    summary["elastic_over_bare_mb"] = summary["elastic_worker_mb"] - summary["bare_torch_mb"]
    summary["elastic_over_ray_actor_mb"] = summary["elastic_worker_mb"] - summary["ray_actor_torch_mb"]
    print("median: " + json.dumps({k: round(v, 1) for k, v in summary.items()}))
    write_results("memory", rows, driver=driver, worker_summary=summary, steps=STEPS, long_run=long_run)


if __name__ == "__main__":
    main()
