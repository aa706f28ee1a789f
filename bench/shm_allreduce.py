"""One sum through Gloo against the same sum through the shared ring of ranks on one machine, without Ray.

Plain torch processes (one thread each) build a `TorchGlooGroup` over a file
store, as workers build theirs over the KV actor, and its `shared_ring()`
(`ray_elastic/collective/shm.py`). Per size and world: rounds alternate the
two paths (which goes first flips every round), each round times `--calls`
in-place float32 sums of the same tensor on each path, and every rank
reports wall and CPU time per call. The figures are rank 0's wall time and
the mean CPU of the ranks, medians over rounds. 3.7 MB is the 0.93M model's
gradients, 92 MB the 23.1M model's.

Prints a table and writes bench/results/shm_allreduce.json. Reports, never asserts.

    .venv/bin/python bench/shm_allreduce.py [--worlds 2,4] [--rounds 5] [--calls 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from results_file import write_results
from spawn_ranks import run_ranks

from ray_elastic.collective.base import Sum
from ray_elastic.collective.torch_gloo import TorchGlooGroup

SIZES_MB = [1.0, 3.7, 16.0, 92.0]


def rank_main(rank: int, world: int, control: str, rounds: int, calls: int, out) -> None:
    torch.set_num_threads(1)
    group = TorchGlooGroup(dist.FileStore(os.path.join(control, "store"), world), rank, world, 120.0)
    ring = group.shared_ring()
    assert ring is not None, "ranks on one machine got no shared ring"
    paths = {"gloo": lambda t: group.allreduce_(t, Sum), "shm": ring.allreduce_sum_}
    found = []
    for mb in SIZES_MB:
        t = torch.ones(int(mb * 1e6 / 4))
        n = max(3, calls if mb < 10 else calls // 10)
        for name in paths:  # warm-up
            paths[name](t)
        for r in range(rounds):
            for name in ("gloo", "shm") if r % 2 == 0 else ("shm", "gloo"):
                group.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(n):
                    paths[name](t)
                found.append(
                    (mb, name, r, (time.perf_counter() - wall) / n * 1e3, (time.process_time() - cpu) / n * 1e3)
                )
    out.put((rank, found))
    group.barrier()
    group.close()


def measure(world: int, rounds: int, calls: int) -> list[dict]:
    by_rank = dict(run_ranks(rank_main, world, (rounds, calls), messages=world, timeout=1200))
    rows = []
    for mb in SIZES_MB:
        row: dict = {"world": world, "mb": mb}
        for name in ("gloo", "shm"):
            walls = [w for m, n, _, w, _ in by_rank[0] if m == mb and n == name]
            cpus = [  # per round, the mean over the ranks
                statistics.mean(
                    next(c for m, n, rr, _, c in by_rank[k] if m == mb and n == name and rr == r) for k in by_rank
                )
                for r in range(rounds)
            ]
            row[f"{name}_ms"] = statistics.median(walls)
            row[f"{name}_cpu_ms"] = statistics.median(cpus)
        row["shm_over_gloo"] = row["shm_ms"] / row["gloo_ms"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=50, help="sums per round and path (a tenth above 10 MB)")
    args = parser.parse_args()
    rows = [row for w in args.worlds.split(",") for row in measure(int(w), args.rounds, args.calls)]
    print(f"{'world':>5} {'MB':>6} {'gloo ms':>8} {'shm ms':>8} {'shm/gloo':>8} {'gloo CPU':>9} {'shm CPU':>8}")
    for r in rows:
        print(
            f"{r['world']:>5} {r['mb']:>6.1f} {r['gloo_ms']:>8.2f} {r['shm_ms']:>8.2f} {r['shm_over_gloo']:>8.3f} "
            f"{r['gloo_cpu_ms']:>9.2f} {r['shm_cpu_ms']:>8.2f}"
        )
    path = write_results("shm_allreduce", rows, rounds=args.rounds, calls=args.calls, threads_per_rank=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
