"""The DDP path's abandonable reduction, without Ray: the hang it ends, and what it costs.

`prepare_model` on Gloo builds each generation's DDP over `_AbandonableGroup`
(ray_elastic/torch/ddp.py), a process group whose allreduce futures the
driver's abandon fails (until 2026-11-24 a communication hook,
`_abandonable_allreduce`, did that; the file keeps its name). Plain torch
processes over `TorchGlooGroup` (the ring our workers use), no Ray, so
neither figure carries Ray's noise:

1. **hang**: 4 ranks train DDP over the 0.93M MLP; at step 3 rank 3 exits
   (its sockets close, as on a SIGKILL) right before its backward. Each
   survivor times its `backward()`; a timer abandons its ring 2 s after the
   backward started, standing for the driver's abandon; the survivors stay
   alive (their links open) until the end, as in a worker. DDP over Gloo
   as it is against DDP over our group. A survivor that has not left
   `backward()` by the deadline (20 s; the process group's timeout is 60 s)
   is reported as still inside.
2. **cost**: world 2, three variants in the same processes, 5 interleaved
   rounds, at 0.93M and 23.1M parameters: `ddp`, DDP as bare scripts and
   Ray Train's `prepare_model` build it (`gradient_as_bucket_view=False`);
   `ddp_views`, the same with `gradient_as_bucket_view=True`; `ours`, as
   `prepare_model` builds it (our group, bucket views, the host-change
   notice reduced behind the first bucket and waited on after the step, as
   in a worker). Wall time per step on rank 0, CPU per step of both ranks'
   processes (Gloo's threads included). Before timing, one step on the same
   batch from the same weights: gradients must be bitwise equal between the
   variants and across ranks.

Prints tables and writes bench/results/ddp_hook.json. Reports, never asserts.

    .venv/bin/python bench/ddp_hook.py [--rounds 5] [--skip-hang] [--models mlp1m,mlp25m]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import statistics
import tempfile
import threading
import time
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results_file import write_results
from spawn_ranks import run_ranks
from throughput import batch, make_model

from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.torch.ddp import _AbandonableGroup, _NoticeCarrier

HANG_DEADLINE_S = 20.0
ABANDON_AFTER_S = 2.0
FAULT_STEP = 3
STEPS = {"mlp1m": 200, "mlp25m": 20}


def _ring(control: str, rank: int, world: int, timeout: float) -> TorchGlooGroup:
    store = dist.FileStore(os.path.join(control, "store"), world)
    return TorchGlooGroup(store, rank, world, timeout)


VARIANTS = ("ddp", "ddp_views", "ours")


def _ddp(model: torch.nn.Module, group: TorchGlooGroup, variant: str) -> tuple[torch.nn.Module, types.SimpleNamespace]:
    owner = types.SimpleNamespace(_carrier=None)  # stands for ElasticDDP, which holds the forward's carrier
    kwargs = {"gradient_as_bucket_view": variant != "ddp"}
    if variant == "ours":
        kwargs["process_group"] = _AbandonableGroup(group, owner)
    return torch.nn.parallel.DistributedDataParallel(model, **kwargs), owner


# ---- 1. the hang --------------------------------------------------------------------------


def _hang_rank(rank: int, world: int, control: str, variant: str, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    group = _ring(control, rank, world, 60.0)
    torch.manual_seed(0)
    model, owner = _ddp(make_model("mlp1m"), group, variant)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(FAULT_STEP + 1):
        x, y = batch("mlp1m", step)
        opt.zero_grad()
        if variant == "ours":
            owner._carrier = _NoticeCarrier(0, 1)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == FAULT_STEP:
            if rank == world - 1:
                os._exit(0)
            timer = threading.Timer(ABANDON_AFTER_S, group.abandon, args=("rank 3 lost (the driver's word)",))
            timer.start()
            start = time.monotonic()
            try:
                loss.backward()
                error = None
            except Exception as e:  # noqa: BLE001 - what the survivor saw is the figure
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            out.put({"rank": rank, "left_after_s": round(time.monotonic() - start, 3), "error": error})
            out.close()
            out.join_thread()
            threading.Event().wait()  # a survivor stays alive, its links open, until the benchmark ends it
        loss.backward()
        opt.step()


def measure_hang(variant: str) -> list[dict]:
    world = 4
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as control:
        procs = [ctx.Process(target=_hang_rank, args=(r, world, control, variant, out)) for r in range(world)]
        for p in procs:
            p.start()
        rows: dict[int, dict] = {}
        deadline = time.monotonic() + 60.0 + HANG_DEADLINE_S  # start-up, then the fault step's deadline
        fault_seen = None
        while len(rows) < world - 1 and time.monotonic() < deadline:
            try:
                row = out.get(timeout=0.2)
                rows[row["rank"]] = row
            except queue.Empty:
                pass
            if fault_seen is None and procs[world - 1].exitcode is not None:
                fault_seen = time.monotonic()
                deadline = fault_seen + HANG_DEADLINE_S
        for r in range(world - 1):
            rows.setdefault(
                r, {"rank": r, "left_after_s": None, "error": f"still in backward() at {HANG_DEADLINE_S:g} s"}
            )
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return [{"variant": variant, **rows[r]} for r in sorted(rows)]


# ---- 2. the cost --------------------------------------------------------------------------


def _grad_digest(model: torch.nn.Module) -> str:
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()[:16]


def _cost_rank(rank: int, world: int, control: str, name: str, rounds: int, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    group = _ring(control, rank, world, 600.0)
    variants = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        model, owner = _ddp(make_model(name), group, variant)
        variants[variant] = (model, owner, torch.optim.SGD(model.parameters(), lr=0.01))

    def step(variant: str, k: int) -> None:
        model, owner, opt = variants[variant]
        x, y = batch(name, k)
        opt.zero_grad()
        if variant == "ours":
            owner._carrier = carrier = _NoticeCarrier(0, 1)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if variant == "ours":
            carrier.reduced(group)  # what check_host_updates() reads after the step

    digests = {}
    for variant in VARIANTS:
        model, owner, opt = variants[variant]
        x, y = batch(name, 0)
        if variant == "ours":
            owner._carrier = _NoticeCarrier(0, 1)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        digests[variant] = _grad_digest(model)
        opt.zero_grad()
    out.put({"rank": rank, "digests": digests})
    steps = STEPS[name]
    k = 1
    for rnd in range(rounds):
        order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
        for variant in order:
            for _ in range(3):  # warm-up
                step(variant, k)
                k += 1
            group.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(variant, k)
                k += 1
            group.barrier()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            out.put(
                {
                    "rank": rank,
                    "round": rnd,
                    "variant": variant,
                    "wall_ms": 1e3 * wall / steps,
                    "cpu_ms": 1e3 * cpu / steps,
                }
            )
    out.close()
    out.join_thread()
    group.close()


def measure_cost(name: str, rounds: int) -> dict:
    world = 2
    records = run_ranks(_cost_rank, world, (name, rounds), messages=world * (1 + len(VARIANTS) * rounds), timeout=900)
    digests = [r["digests"] for r in records if "digests" in r]
    equal = len({d[v] for d in digests for v in VARIANTS}) == 1
    windows = [r for r in records if "variant" in r]

    def per_round(variant: str, key: str, ranks: str) -> list[float]:
        vals = []
        for rnd in range(rounds):
            rows = [w for w in windows if w["round"] == rnd and w["variant"] == variant]
            vals.append(next(w[key] for w in rows if w["rank"] == 0) if ranks == "rank0" else sum(w[key] for w in rows))
        return vals

    row: dict = {"model": name, "world": world, "grads_bitwise_equal": equal}
    wall = {v: per_round(v, "wall_ms", "rank0") for v in VARIANTS}
    cpu = {v: per_round(v, "cpu_ms", "all") for v in VARIANTS}
    for v in VARIANTS:
        row[f"{v}_wall_ms"] = round(statistics.median(wall[v]), 3)
        row[f"{v}_cpu_ms"] = round(statistics.median(cpu[v]), 3)
    for v in ("ddp", "ddp_views"):  # ours over each: ratios of time, so above 1 means ours is slower
        walls = [o / d for o, d in zip(wall["ours"], wall[v], strict=True)]
        row[f"ours_over_{v}_wall"] = round(statistics.median(walls), 3)
        row[f"ours_over_{v}_cpu"] = round(statistics.median(o / d for o, d in zip(cpu["ours"], cpu[v], strict=True)), 3)
        row[f"ours_over_{v}_wall_per_round"] = [round(r, 3) for r in walls]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip-hang", action="store_true")
    parser.add_argument("--models", default="mlp1m,mlp25m", help="comma-separated, of: " + ", ".join(STEPS))
    args = parser.parse_args()
    hang: list[dict] = []
    if not args.skip_hang:
        for variant in ("ddp", "ours"):
            hang += measure_hang(variant)
        print(
            f"\nrank 3 of 4 gone before its backward; a timer abandons each survivor's ring {ABANDON_AFTER_S:g} s "
            "into its backward"
        )
        print(f"{'variant':8} {'rank':>4} {'left backward() after':>22}  error")
        for row in hang:
            left = "-" if row["left_after_s"] is None else f"{row['left_after_s']:.2f} s"
            print(f"{row['variant']:8} {row['rank']:>4} {left:>22}  {row['error']}")
    cost = [measure_cost(name, args.rounds) for name in args.models.split(",")]
    print(f"\nworld 2, {args.rounds} interleaved rounds; ms per step (wall on rank 0, CPU of both ranks)")
    print(
        f"{'model':8} {'wall ddp':>9} {'views':>7} {'ours':>7} {'ours/ddp':>9} {'ours/views':>11} "
        f"{'CPU ddp':>8} {'views':>7} {'ours':>7} {'ours/ddp':>9} {'ours/views':>11}  grads equal"
    )
    for c in cost:
        print(
            f"{c['model']:8} {c['ddp_wall_ms']:>9.2f} {c['ddp_views_wall_ms']:>7.2f} {c['ours_wall_ms']:>7.2f} "
            f"{c['ours_over_ddp_wall']:>9.3f} {c['ours_over_ddp_views_wall']:>11.3f} {c['ddp_cpu_ms']:>8.2f} "
            f"{c['ddp_views_cpu_ms']:>7.2f} {c['ours_cpu_ms']:>7.2f} {c['ours_over_ddp_cpu']:>9.3f} "
            f"{c['ours_over_ddp_views_cpu']:>11.3f}  {c['grads_bitwise_equal']}"
        )
    write_results(
        "ddp_hook", hang + cost, rounds=args.rounds, abandon_after_s=ABANDON_AFTER_S, hang_deadline_s=HANG_DEADLINE_S
    )


if __name__ == "__main__":
    main()
