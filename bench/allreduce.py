"""Allreduce throughput of each backend against raw `torch.distributed.all_reduce` on the same ranks.

Ranks are Ray actors on a local Ray of their own. Each builds the backend's
group through `make_group` over a real KV actor, as workers do. For torch Gloo
the baseline is `dist.all_reduce` on the very process group our group created,
in the same processes, so the ratio is what our path adds per call (staging,
error mapping, activity tracking). Rounds interleave raw and ours; each round
runs as many allreduces (SUM, float32, in place) as fit in about 0.05 s, the
order of the two flips every round, and the ratio is the median of the
per-round ratios (robust to the load of a shared machine drifting). pygloo runs where it imports (the Python 3.10 venv,
which has no torch): its baseline there is a raw `pygloo.allreduce` on the
same context, and its figures go to a results file of their own.

Prints a table and writes bench/results/allreduce.json (allreduce_pygloo.json
for pygloo). Reports, never asserts.

    .venv/bin/python bench/allreduce.py [--ranks 2] [--rounds 5]
    .venv310/bin/python bench/allreduce.py            # pygloo, in the 3.10 venv
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
import time
import uuid

import numpy as np
import ray
from results_file import write_results

from ray_elastic.collective.base import Sum
from ray_elastic.collective.factory import load_backend, make_group
from ray_elastic.rendezvous import KVClient, create_kv_actor

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
ROUND_S = 0.05


@ray.remote(num_cpus=0)
class Rank:
    def __init__(self, backend: str, kv, rank: int, size: int) -> None:
        load_backend(backend)
        self.backend = backend
        self.group = make_group(backend, KVClient(kv), 1, rank, size, 120.0)

    def _raw(self, array: np.ndarray):
        """One raw allreduce call of the backend's own library, bypassing our group's path."""
        if self.backend == "pygloo":
            import pygloo

            ctx, ptr, n = self.group._context, array.ctypes.data, array.size
            return lambda: pygloo.allreduce(ctx, ptr, ptr, n, pygloo.glooDataType_t.glooFloat32, pygloo.ReduceOp.SUM)
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(array)
        return lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM)

    def measure(self, nbytes: int, iters: int, rounds: int, values: str) -> dict[str, list[float]]:
        """Seconds per allreduce, per round, for raw and ours (rounds interleaved).

        `values`: what our path is handed, "numpy" (the array) or "torch" (a tensor sharing its memory).
        """
        array = np.ones(nbytes // 4, dtype=np.float32)
        raw = self._raw(array)
        value = array
        if values == "torch":
            import torch

            value = torch.from_numpy(array)
        ours = lambda: self.group.allreduce_(value, Sum)  # noqa: E731
        out: dict[str, list[float]] = {"raw": [], "ours": []}
        for fn in (raw, ours):  # warm-up: the first calls of a size allocate
            fn()
        for i in range(rounds):
            for name, fn in (("raw", raw), ("ours", ours))[:: 1 if i % 2 else -1]:
                self.group.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                out[name].append((time.perf_counter() - start) / iters)
        return out

    def probe(self, nbytes: int) -> float:
        """Seconds for one allreduce of `nbytes` (to size the rounds)."""
        array = np.ones(nbytes // 4, dtype=np.float32)
        self.group.allreduce_(array, Sum)
        start = time.perf_counter()
        self.group.allreduce_(array, Sum)
        return time.perf_counter() - start


def run_backend(backend: str, ranks: int, rounds: int, sizes: list[int], values: str) -> list[dict]:
    kv = create_kv_actor(f"bench-{uuid.uuid4().hex[:6]}", f"ray_elastic_bench_{uuid.uuid4().hex[:8]}")
    ray.get(kv.publish.remote(1, {"world_size": ranks}))
    members = [Rank.remote(backend, kv, r, ranks) for r in range(ranks)]
    ray.get([m.probe.remote(4 << 10) for m in members], timeout=300)
    rows = []
    for nbytes in sizes:
        once = max(ray.get([m.probe.remote(nbytes) for m in members]))
        iters = max(1, min(2000, int(ROUND_S / max(once, 1e-6))))
        results = ray.get([m.measure.remote(nbytes, iters, rounds, values) for m in members], timeout=600)
        raw = statistics.median(results[0]["raw"])
        ours = statistics.median(results[0]["ours"])
        ratio = statistics.median(r / o for r, o in zip(results[0]["raw"], results[0]["ours"], strict=True))
        bus = 2 * (ranks - 1) / ranks  # bytes each rank sends per byte reduced, ring allreduce
        rows.append(
            {
                "backend": backend,
                "values": values,
                "ranks": ranks,
                "bytes": nbytes,
                "iters_per_round": iters,
                "raw_s": raw,
                "ours_s": ours,
                "raw_busbw_MBps": nbytes * bus / raw / 1e6,
                "ours_busbw_MBps": nbytes * bus / ours / 1e6,
                "ours_over_raw": ratio,
                "raw_rounds_s": results[0]["raw"],
                "ours_rounds_s": results[0]["ours"],
            }
        )
        r = rows[-1]
        print(
            f"{backend:7s} {ranks} ranks {human(nbytes):>7s}  raw {raw * 1e3:9.3f} ms {r['raw_busbw_MBps']:8.1f} MB/s"
            f"   ours {ours * 1e3:9.3f} ms {r['ours_busbw_MBps']:8.1f} MB/s   ours/raw {r['ours_over_raw']:.3f}",
            flush=True,
        )
    for m in members:
        ray.kill(m)
    ray.kill(kv)
    return rows


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2", help="comma-separated world sizes, e.g. 2,4")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated message sizes in bytes")
    parser.add_argument("--values", choices=["numpy", "torch"], default="numpy", help="what our path is handed")
    args = parser.parse_args()
    backends = [b for b, lib in (("gloo", "torch"), ("pygloo", "pygloo")) if importlib.util.find_spec(lib)]
    ranks = [int(r) for r in args.ranks.split(",")]
    sizes = [int(n) for n in args.sizes.split(",")]
    ray.init(address="local", num_cpus=max(ranks), logging_level=logging.WARNING)
    try:
        rows = []
        for backend in backends:
            values = args.values if backend == "gloo" else "numpy"  # the pygloo venv has no torch
            for n in ranks:
                rows += run_backend(backend, n, args.rounds, sizes, values)
    finally:
        ray.shutdown()
    for backend in backends:
        name = "allreduce" if backend == "gloo" else f"allreduce_{backend}"
        write_results(name, [r for r in rows if r["backend"] == backend], rounds=args.rounds, sizes=sizes)


if __name__ == "__main__":
    main()
