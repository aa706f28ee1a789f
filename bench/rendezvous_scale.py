"""Rendezvous at scale, by simulation: one generation's store traffic for N ranks.

A real Gloo full mesh of 1024 ranks cannot run on two cores, but its store
traffic can: N simulated ranks (threads spread over a few Ray actors) run the
very calls a worker makes against the real KV actor when a ring forms:

1. `wait_generation` (blocked before the driver publishes the plan of N slots);
2. `set` of the rank's Gloo address (178 bytes, the size torch 2.13 writes);
3. for every rank r in 0..N-1, `wait([addr_r])` then `get(addr_r)`: the order
   in which Gloo's `connectFullMesh` reads the addresses (counted with a
   recording store), through the real `KVTorchStore`.

`ours` is the code as it is: the plan comes back as the rank's own slot and
the N addresses in one `wait_family` call. `key-at-a-time` is the traffic
before that fix (the whole plan to every rank, 2N^2 + N key calls), run at the
smallest N only because it grows quadratically. Time runs from the publish to
the last rank holding every address; calls are counted by the KV actor.

Also times the driver's decision for 1000 hosts x 8 slots (`plan_scaling`,
`assign_ranks`, the cool-down) and records the KV actor's RSS after the
largest generation. Prints tables and writes bench/results/rendezvous_scale.json.
Reports, never asserts.

    .venv/bin/python bench/rendezvous_scale.py [--ranks 64,256,1024] [--procs 4]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psutil
import ray
from results_file import write_results

from ray_elastic.assignment import Cooldown, LiveWorker, WorkerSlot, assign_ranks, plan_scaling
from ray_elastic.collective.torch_store import torch_store
from ray_elastic.rendezvous import KVClient, create_kv_actor

ADDR_BYTES = 178  # what torch 2.13's Gloo writes per rank
TIMEOUT_S = 120.0
PREFIX = "0//cpu//0/"  # the key prefix init_process_group's Gloo uses


@ray.remote(num_cpus=0)
class NoopService:
    """The floor of any rendezvous served by one async Ray actor: a call that does nothing."""

    async def call(self) -> None:
        return None


@ray.remote(num_cpus=0)
class SimHost:
    """One process holding many simulated ranks, one thread each."""

    def pid(self) -> int:
        """The process id, once the modules a worker has loaded before it forms a ring are imported.

        A worker imports torch.distributed long before its first rendezvous;
        importing it lazily here, in 256 threads at once, would time the import.
        """
        import ray_elastic.collective.torch_store  # noqa: F401

        return int(__import__("os").getpid())

    def run(self, kv: ray.actor.ActorHandle, ranks: list[int], size: int, batched: bool) -> list[float]:
        """Each rank's traffic for one generation; returns when each rank finished (time.time())."""
        client = KVClient(kv)

        def one_rank(rank: int) -> float:
            worker_id = f"w{rank}"
            if batched:
                generation, plan = client.wait_generation(0, TIMEOUT_S, worker_id)
            else:
                generation, plan = client.wait_generation(0, TIMEOUT_S)
            assert plan[worker_id].rank == rank
            store = torch_store(client, generation, TIMEOUT_S, size if batched else None)
            store.set(f"{PREFIX}{rank}", b"a" * ADDR_BYTES)
            for peer in range(size):
                store.wait([f"{PREFIX}{peer}"])
                store.get(f"{PREFIX}{peer}")
            return time.time()

        with ThreadPoolExecutor(len(ranks)) as pool:
            return list(pool.map(one_rank, ranks))

    def run_noop(self, service: ray.actor.ActorHandle, ranks: list[int], calls: int) -> list[float]:
        """Each rank makes `calls` no-op calls in a row; returns when each rank finished."""

        def one_rank(_rank: int) -> float:
            for _ in range(calls):
                ray.get(service.call.remote(), timeout=TIMEOUT_S)
            return time.time()

        with ThreadPoolExecutor(len(ranks)) as pool:
            return list(pool.map(one_rank, ranks))


def wait_for(what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def actor_pid(handle: ray.actor.ActorHandle) -> int:
    """The actor's process id, from the GCS's actor table (works without the dashboard)."""
    from ray._private.state import actors

    return int(actors(handle._actor_id.hex())["Pid"])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes have used so far."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def one_generation(hosts: list, host_pids: list[int], size: int, batched: bool) -> dict:
    namespace = f"ray_elastic_bench_rdzv_{uuid.uuid4().hex[:8]}"
    kv = create_kv_actor(f"bench-{namespace}", namespace)
    ray.get(kv.current_generation.remote(), timeout=60)
    plan = {f"w{r}": WorkerSlot(f"w{r}", f"host{r // 8}", r, size, r % 8, 8, r // 8, size // 8) for r in range(size)}
    parts = [list(range(i, size, len(hosts))) for i in range(len(hosts))]
    refs = [h.run.remote(kv, part, size, batched) for h, part in zip(hosts, parts, strict=True)]
    # every simulated rank is blocked in wait_generation before the driver publishes
    wait_for(f"{size} ranks waiting for the generation", lambda: ray.get(kv.stats.remote())["calls"] >= size, 120)
    calls_before = ray.get(kv.stats.remote())["calls"]
    kv_pid = actor_pid(kv)
    kv_cpu, hosts_cpu = cpu_seconds([kv_pid]), cpu_seconds(host_pids)
    start = time.time()
    ray.get(kv.publish.remote(1, plan))
    done = [t for part in ray.get(refs, timeout=600) for t in part]
    elapsed = max(done) - start
    kv_cpu, hosts_cpu = cpu_seconds([kv_pid]) - kv_cpu, cpu_seconds(host_pids) - hosts_cpu
    calls = ray.get(kv.stats.remote())["calls"] - calls_before + size  # + the N generation waits
    rss = psutil.Process(kv_pid).memory_info().rss
    ray.kill(kv)
    return {
        "ranks": size,
        "traffic": "ours" if batched else "key-at-a-time",
        "seconds": elapsed,
        "kv_calls": calls,
        "calls_per_rank": calls / size,
        "p50_rank_s": statistics.median(done) - start,
        "kv_rss_mb": rss / 2**20,
        # CPU seconds used during the generation: the KV actor's (the service) and the simulated
        # clients' (N ranks' client work that a real job spreads over N processes)
        "kv_cpu_s": kv_cpu,
        "clients_cpu_s": hosts_cpu,
    }


def noop_floor(hosts: list, host_pids: list[int], size: int) -> dict:
    """N ranks making 2 no-op calls each to one async actor, the same way: what Ray's calls alone cost."""
    service = NoopService.options(max_concurrency=100_000).remote()
    ray.get(service.call.remote(), timeout=60)
    service_pid = actor_pid(service)
    parts = [list(range(i, size, len(hosts))) for i in range(len(hosts))]
    service_cpu, hosts_cpu = cpu_seconds([service_pid]), cpu_seconds(host_pids)
    start = time.time()
    done = [
        t
        for part in ray.get([h.run_noop.remote(service, p, 2) for h, p in zip(hosts, parts, strict=True)])
        for t in part
    ]
    row = {
        "ranks": size,
        "traffic": "2 no-op calls",
        "seconds": max(done) - start,
        "kv_calls": 2 * size,
        "calls_per_rank": 2.0,
        "p50_rank_s": statistics.median(done) - start,
        "kv_rss_mb": psutil.Process(service_pid).memory_info().rss / 2**20,
        "kv_cpu_s": cpu_seconds([service_pid]) - service_cpu,
        "clients_cpu_s": cpu_seconds(host_pids) - hosts_cpu,
    }
    ray.kill(service)
    return row


def driver_decision(hosts: int, slots: int, reps: int) -> dict:
    """Time the driver's pure decisions for a full cluster: one reconcile and one rank assignment."""
    offered = {f"node{h:04d}": slots for h in range(hosts)}
    first_seen = {h: float(i) for i, h in enumerate(offered)}
    workers = [LiveWorker(f"w{h}-{s}", f"node{h:04d}", h * slots + s) for h in range(hosts) for s in range(slots)]
    # a realistic moment: 1% of hosts cooling after failures, 1% of the workers gone
    cooldown = Cooldown(10, 300)
    for h in range(0, hosts, 100):
        cooldown.record_failure(f"node{h:04d}", 0.0)
    survivors = workers[: len(workers) - len(workers) // 100]
    samples = {"plan_scaling": [], "assign_ranks": [], "cooling": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        cooling = cooldown.cooling(1.0)
        t1 = time.perf_counter()
        plan_scaling(survivors, offered, first_seen, cooling, hosts * slots)
        t2 = time.perf_counter()
        assign_ranks(survivors)
        t3 = time.perf_counter()
        samples["cooling"].append(t1 - t0)
        samples["plan_scaling"].append(t2 - t1)
        samples["assign_ranks"].append(t3 - t2)
    row = {k: statistics.median(v) for k, v in samples.items()}
    row["total_s"] = sum(row.values())
    row.update(hosts=hosts, slots=slots, workers=len(survivors))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,256,1024")
    parser.add_argument("--procs", type=int, default=4, help="processes the simulated ranks are spread over")
    parser.add_argument("--legacy-ranks", type=int, default=64, help="N for the key-at-a-time traffic")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, logging_level=logging.ERROR, include_dashboard=False)
    hosts = [SimHost.remote() for _ in range(args.procs)]
    host_pids = ray.get([h.pid.remote() for h in hosts], timeout=120)
    rows = [one_generation(hosts, host_pids, args.legacy_ranks, batched=False)]
    for size in [int(n) for n in args.ranks.split(",")]:
        rows.append(one_generation(hosts, host_pids, size, batched=True))
    # the same number of Ray calls doing nothing, at the largest N: the floor under any actor-served rendezvous
    rows.append(noop_floor(hosts, host_pids, max(int(n) for n in args.ranks.split(","))))
    ray.shutdown()
    print(
        f"{'ranks':>6} {'traffic':>14} {'seconds':>8} {'calls':>9} {'calls/rank':>10} {'KV RSS':>8} "
        f"{'KV CPU s':>8} {'clients CPU s':>13}"
    )
    for r in rows:
        print(
            f"{r['ranks']:>6} {r['traffic']:>14} {r['seconds']:>8.3f} {r['kv_calls']:>9} "
            f"{r['calls_per_rank']:>10.1f} {r['kv_rss_mb']:>6.0f}MB {r['kv_cpu_s']:>8.2f} {r['clients_cpu_s']:>13.2f}"
        )
    decision = driver_decision(1000, 8, reps=20)
    print(
        f"driver decision, {decision['hosts']} hosts x {decision['slots']} slots ({decision['workers']} workers): "
        f"plan_scaling {decision['plan_scaling'] * 1e3:.2f} ms, assign_ranks {decision['assign_ranks'] * 1e3:.2f} ms, "
        f"cool-down {decision['cooling'] * 1e3:.3f} ms, total {decision['total_s'] * 1e3:.2f} ms"
    )
    write_results("rendezvous_scale", rows, procs=args.procs, addr_bytes=ADDR_BYTES, driver_decision=decision)


if __name__ == "__main__":
    main()
