"""What fencing the data plane costs: a step, a ring's formation, and an abandon, without Ray.

An abandoned Gloo ring is cut (`ray_elastic/collective/ring_sockets.py`):
its connections are noted while the process group forms and shut down on
abandon, and the abandon returns once the ring's pending works ended.
Nothing is added to a step. This measures that, side by side in one run:

- a step: plain torch processes (one thread each) over a `TorchGlooGroup`
  (fenced) and over the same group without its connections noted (unfenced),
  each step one asynchronous bucket allreduce of `--mb` MB waited on, as
  `DistributedOptimizer` does; rounds alternate the two (which goes first
  flips every round), rank 0's wall time per step, median over rounds;
- forming a ring: `init_process_group` with and without noting the
  connections, in processes holding `--fds` extra sockets (a Ray worker
  holds a few hundred descriptors);
- an abandon: from `abandon()` on a control thread, while a bucket waits on a
  silent rank, to its return (connections cut, pending works ended).

Prints a table and writes bench/results/fencing.json. Reports, never asserts.

    .venv/bin/python bench/fencing.py [--world 3] [--rounds 7] [--steps 30] [--mb 16] [--fds 300]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time

import torch
import torch.distributed as dist
from results_file import write_results
from spawn_ranks import run_ranks

from ray_elastic.collective.base import Average
from ray_elastic.collective.torch_gloo import TorchGlooGroup


class UnfencedGroup(TorchGlooGroup):
    """The same group with nothing noted at its formation: what every step cost before fencing."""

    def _create(self, create) -> None:
        create()


def _group(cls: type, rank: int, world: int, store_dir: str) -> tuple[TorchGlooGroup, float]:
    os.makedirs(store_dir, exist_ok=True)
    started = time.perf_counter()
    group = cls(dist.FileStore(os.path.join(store_dir, "store"), world), rank, world, 60.0)
    return group, time.perf_counter() - started


def rank_main(rank: int, world: int, control: str, rounds: int, steps: int, mb: float, fds: int, out) -> None:
    torch.set_num_threads(1)
    held = [socket.socket() for _ in range(fds)]  # a Ray worker's descriptors, for the scans at formation
    kinds = {"fenced": TorchGlooGroup, "unfenced": UnfencedGroup}
    bucket = torch.ones(int(mb * 1e6 / 4))
    step_ms: dict[str, list[float]] = {k: [] for k in kinds}
    form_ms: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in kinds if r % 2 == 0 else reversed(list(kinds)):
            group, formed = _group(kinds[kind], rank, world, os.path.join(control, f"{kind}-{r}"))
            form_ms[kind].append(formed * 1e3)
            group.allreduce_async(bucket, Average).wait()  # warm-up
            group.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                group.allreduce_async(bucket, Average).wait()
            step_ms[kind].append((time.perf_counter() - started) / steps * 1e3)
            group.barrier()
            group.close()
    abandon_ms = []
    for r in range(rounds):  # rank world-1 stays silent; the others abandon while their bucket waits on it
        group, _ = _group(TorchGlooGroup, rank, world, os.path.join(control, f"abandon-{r}"))
        group.barrier()
        if rank != world - 1:
            took: list[float] = []

            def abandon_soon(group=group, took=took) -> None:
                time.sleep(0.2)  # the bucket is blocked on the silent rank by then
                started = time.perf_counter()
                group.abandon("benchmark")
                took.append(time.perf_counter() - started)

            thread = threading.Thread(target=abandon_soon)
            thread.start()
            try:
                group.allreduce_async(bucket, Average).wait()
            except Exception:  # noqa: BLE001 - the abandon's HorovodInternalError, expected
                pass
            thread.join()
            abandon_ms.append(took[0] * 1e3)
        group.close()
    out.put((rank, step_ms, form_ms, abandon_ms))
    for s in held:
        s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mb", type=float, default=16.0)
    parser.add_argument("--fds", type=int, default=300)
    args = parser.parse_args()
    found = dict(
        (rank, rest)
        for rank, *rest in run_ranks(
            rank_main, args.world, (args.rounds, args.steps, args.mb, args.fds), args.world, timeout=600
        )
    )
    step_ms, form_ms, _ = found[0]
    med = statistics.median
    ratios = [f / u for f, u in zip(step_ms["fenced"], step_ms["unfenced"], strict=True)]
    rows = [
        {
            "what": f"step ({args.mb:g} MB bucket, world {args.world})",
            "fenced_ms": med(step_ms["fenced"]),
            "unfenced_ms": med(step_ms["unfenced"]),
            "ratio_median": med(ratios),
            "ratio_range": [min(ratios), max(ratios)],
        },
        {
            "what": f"forming a ring ({args.fds} extra sockets held)",
            "fenced_ms": med(form_ms["fenced"]),
            "unfenced_ms": med(form_ms["unfenced"]),
            "ratio_median": med(f / u for f, u in zip(form_ms["fenced"], form_ms["unfenced"], strict=True)),
        },
        {"what": "abandon: cut and pending works ended (ranks 0..world-2, all rounds)"}
        | {"median_ms": med(a for r in range(args.world - 1) for a in found[r][2])}
        | {"max_ms": max(a for r in range(args.world - 1) for a in found[r][2])},
    ]
    print(f"{'what':58} {'fenced ms':>10} {'unfenced ms':>12} {'ratio':>8}")
    for row in rows[:2]:
        print(f"{row['what']:58} {row['fenced_ms']:10.2f} {row['unfenced_ms']:12.2f} {row['ratio_median']:8.3f}")
    print(f"{rows[2]['what']:58} median {rows[2]['median_ms']:.2f} ms, max {rows[2]['max_ms']:.2f} ms")
    write_results("fencing", rows, world=args.world, rounds=args.rounds, steps=args.steps, mb=args.mb, fds=args.fds)


if __name__ == "__main__":
    main()
