"""DistributedOptimizer before and after a change, side by side in one run: alternating rounds of two checkouts.

Each round runs one checkout of the library in subprocesses (`PYTHONPATH`
and the working directory set to that tree, so the driver, the Ray workers
and the driver actor all import its `ray_elastic`; each subprocess checks
which file its workers imported). The rounds alternate in pairs, before
then after, then after then before (ABBA), so a load that drifts across the
run falls alike on both. The bench scripts are this directory's for both
trees. A round is three measurements:

- throughput (`throughput.measure`, the `elastic` system: `DistributedOptimizer`
  in `ElasticTrainer` workers, `check_host_updates()` every step, `commit()`
  every 10) on the 0.93M MLP, with bare DDP taking turns beside it in the
  same round as a reference the change cannot touch (`elastic / ddp` per
  window cancels a load change within the round);
- recovery (`recovery.one_rep`, `DistributedOptimizer` path only): one of 4
  workers SIGKILLed, time until the survivors' next step; the same seeded
  kills in every round;
- the step's own cost in a world of one without Ray (the unit tests'
  set-up: a real `WorkerContext` on a Gloo ring of one rank): per step,
  `zero_grad` + forward + backward + `step()`, and `step()` alone.

The subprocesses that start Ray run under the machine's Ray lock
(`/tmp/ray_cluster.lock`, as `flock` takes it), held for one pair of rounds
at a time (a few minutes), so other users of the machine get it between
pairs; the world-of-one measurement runs outside it. Prints per-round
figures, medians and after/before ratios, and writes
bench/results/optimizer_ab.json. Reports, never asserts.

    git worktree add --detach /tmp/ab_before <old>; git worktree add --detach /tmp/ab_after <new>
    .venv/bin/python bench/optimizer_ab.py --before /tmp/ab_before --after /tmp/ab_after [--rounds 3]
        [--kinds micro,throughput,recovery] [--name optimizer_ab]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
LOCK = "/tmp/ray_cluster.lock"
MODEL = "mlp1m"


# ---- the children: one measurement of one tree, printed as JSON on the last line --------------------------


def _imported_by_workers() -> dict[str, Any]:
    """Which `ray_elastic` a Ray worker of this job imports, and whether its optimizer is a torch one."""
    import ray

    @ray.remote(num_cpus=0)
    def where() -> dict[str, Any]:
        import torch

        import ray_elastic
        from ray_elastic.torch import DistributedOptimizer

        return {
            "file": ray_elastic.__file__,
            "is_torch_optimizer": issubclass(DistributedOptimizer, torch.optim.Optimizer),
        }

    return ray.get(where.remote(), timeout=120)


def child_throughput(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from own_dashboard import own_dashboard
    from throughput import measure

    systems = ["elastic", "ddp"] if args.reference else ["elastic"]
    ray.init(address="local", num_cpus=2 * max(args.worlds), logging_level=logging.ERROR, **own_dashboard())
    workers = _imported_by_workers()
    os.nice(max(0, int(os.environ.get("RAY_worker_niceness", "15")) - os.nice(0)))  # as throughput.py: one priority
    out: dict[str, Any] = {"workers": workers, "worlds": {}}
    for world in args.worlds:
        samples, cpu = measure(MODEL, world, args.steps, args.windows, systems)
        out["worlds"][str(world)] = {
            "samples_per_s": samples,
            "rank_cpu_ms_per_step": {
                s: [w["classes"].get("ranks (timed system)", 0.0) / (args.steps + 3) * 1e3 for w in cpu[s]]
                for s in systems
            },
        }
    ray.shutdown()
    return out


def child_recovery(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from own_dashboard import own_dashboard
    from ray.cluster_utils import Cluster
    from recovery import one_rep

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **own_dashboard()})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    cluster.wait_for_nodes()
    workers = _imported_by_workers()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for rep in range(args.reps):
            kill_step, kill_rank = rng.randint(30, 120), rng.randint(0, 3)
            rows.append(one_rep(kill_rank, kill_step, workdir, rep))
    ray.shutdown()
    cluster.shutdown()
    return {"workers": workers, "rows": rows}


def child_micro(args: argparse.Namespace) -> dict[str, Any]:
    """Per-step times in a world of one (no Ray): the step's own Python and copies, without a peer to wait for."""
    import torch
    import torch.distributed as dist
    from throughput import batch, make_model

    import ray_elastic
    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.collective.torch_gloo import TorchGlooGroup
    from ray_elastic.protocol import WorkerConfig
    from ray_elastic.runtime import metrics_shipper
    from ray_elastic.runtime.context import WorkerContext
    from ray_elastic.runtime.process import set_current
    from ray_elastic.torch import DistributedOptimizer

    class NoDriver:
        def __getattr__(self, method: str) -> Any:
            class Method:
                def remote(self, *a: Any) -> None:
                    return None

            return Method()

    metrics_shipper.ray.get = lambda ref, timeout=None: ref  # no driver to ship to: never start a Ray
    torch.set_num_threads(1)
    ctx = WorkerContext("w0", kv=None, driver=NoDriver(), settings=WorkerConfig(backend="gloo"))
    set_current(ctx)
    ctx.membership.group = TorchGlooGroup(dist.HashStore(), 0, 1, 30.0)
    ctx.membership.slot = WorkerSlot("w0", "host", 0, 1, 0, 1, 0, 1)
    ctx.membership.generation = 1
    torch.manual_seed(0)
    model = make_model(MODEL)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    data = [batch(MODEL, i) for i in range(16)]
    whole, step_only = [], []
    for i in range(args.warmup + args.steps):
        x, y = data[i % len(data)]
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= args.warmup:
            whole.append(t2 - t0)
            step_only.append(t2 - t1)
    set_current(None)
    ctx.shutdown()
    return {
        "workers": {"file": ray_elastic.__file__, "is_torch_optimizer": isinstance(opt, torch.optim.Optimizer)},
        "step_us": statistics.median(whole) * 1e6,
        "opt_step_us": statistics.median(step_only) * 1e6,
    }


CHILDREN = {"throughput": child_throughput, "recovery": child_recovery, "micro": child_micro}


# ---- the orchestrator --------------------------------------------------------------------------------------


def run_child(kind: str, tree: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement of `tree` in a fresh interpreter (the caller holds the cluster lock when it starts Ray)."""
    cmd = [sys.executable, str(BENCH / "optimizer_ab.py"), "--child", kind, *args.child_args]
    env = {**os.environ, "PYTHONPATH": tree, "RAY_TRAIN_V2_ENABLED": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} in {tree} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = os.path.join(os.path.realpath(tree), "ray_elastic", "__init__.py")
    if os.path.realpath(result["workers"]["file"]) != expected:
        raise RuntimeError(f"{kind} in {tree}: its workers imported {result['workers']['file']}, not {expected}")
    result["wall_s"] = time.monotonic() - t0
    return result


@contextlib.contextmanager
def cluster_lock() -> Iterator[float]:
    """Hold the machine's Ray lock (what `flock /tmp/ray_cluster.lock` takes); yields the seconds waited."""
    t0 = time.monotonic()
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - t0
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="worktree of the old code")
    parser.add_argument("--after", help="worktree of the new code")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per tree: pairs, before/after then after/before")
    parser.add_argument("--worlds", default="2", help="throughput world sizes")
    parser.add_argument("--steps", type=int, default=500, help="timed steps per throughput window")
    parser.add_argument("--windows", type=int, default=3, help="throughput windows per round")
    parser.add_argument("--no-reference", dest="reference", action="store_false", help="no DDP windows")
    parser.add_argument("--reps", type=int, default=2, help="recovery repetitions per round (0 to skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-steps", type=int, default=300, help="world-of-one steps per round (0 to skip)")
    parser.add_argument("--kinds", default="micro,throughput,recovery", help="which measurements each round takes")
    parser.add_argument("--name", default="optimizer_ab", help="results file: bench/results/<name>.json")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.worlds = [int(w) for w in args.worlds.split(",")]
    if args.child:
        args.warmup = 20
        if args.child == "micro":
            args.steps = args.micro_steps
        print(json.dumps(CHILDREN[args.child](args)), flush=True)
        return
    args.child_args = [
        f"--worlds={','.join(map(str, args.worlds))}",
        f"--steps={args.steps}",
        f"--windows={args.windows}",
        f"--reps={args.reps}",
        f"--seed={args.seed}",
        f"--micro-steps={args.micro_steps}",
        *([] if args.reference else ["--no-reference"]),
    ]
    if not (args.before and args.after):
        parser.error("--before and --after name the two worktrees")
    trees = {"before": args.before, "after": args.after}
    kinds = args.kinds.split(",")
    on_ray = [k for k in ("throughput", "recovery") if k in kinds and (k != "recovery" or args.reps)]
    rounds: list[dict[str, Any]] = []
    start = time.monotonic()
    for pair in range(args.rounds):
        order = ("before", "after") if pair % 2 == 0 else ("after", "before")  # A B, B A, A B ...
        rows = {v: {"round": 2 * pair + i, "version": v, "tree": trees[v]} for i, v in enumerate(order)}
        if "micro" in kinds and args.micro_steps:
            for v in order:
                rows[v]["micro"] = run_child("micro", trees[v], args)
        # one pair back to back under one hold of the lock (a few minutes); none without Ray
        with cluster_lock() if on_ray else contextlib.nullcontext(0.0) as waited:
            for v in order:
                rows[v]["lock_wait_s"] = waited
                for kind in on_ray:
                    rows[v][kind] = run_child(kind, trees[v], args)
        for v in order:
            rounds.append(rows[v])
            print(
                f"[{time.monotonic() - start:.0f} s] round {rows[v]['round']} {v}: " + describe(rows[v], args.worlds),
                flush=True,
            )
        save(rounds, trees, args, time.monotonic() - start)  # after every pair: an interrupted run keeps its rounds
    summary = save(rounds, trees, args, time.monotonic() - start)
    print("\nmedians over rounds, and after / before:")
    for key, value in summary.items():
        print(f"  {key}: before {value['before']:.4g}, after {value['after']:.4g}, after/before {value['ratio']:.4f}")


def save(rounds: list[dict[str, Any]], trees: dict[str, str], args: argparse.Namespace, wall_s: float) -> dict:
    """Write bench/results/optimizer_ab.json with the rounds so far; return the summary."""
    from results_file import write_results

    summary = summarize(rounds, args.worlds)
    write_results(
        args.name,
        rounds,
        summary=summary,
        commits={v: git_head(t) for v, t in trees.items()},
        model=MODEL,
        args={k: v for k, v in vars(args).items() if k not in ("child", "child_args")},
        bench_wall_s=wall_s,
    )
    return summary


def git_head(tree: str) -> str:
    return subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def round_figures(row: dict[str, Any], worlds: list[int]) -> dict[str, float]:
    """One round's figures: medians over its windows / repetitions."""
    fig: dict[str, float] = {}
    if "micro" in row:
        fig["micro step_us"] = row["micro"]["step_us"]
        fig["micro opt.step()_us"] = row["micro"]["opt_step_us"]
    for w in worlds if "throughput" in row else []:
        per = row["throughput"]["worlds"][str(w)]
        fig[f"world {w} elastic samples/s"] = statistics.median(per["samples_per_s"]["elastic"])
        fig[f"world {w} elastic rank CPU ms/step"] = statistics.median(per["rank_cpu_ms_per_step"]["elastic"])
        if "ddp" in per["samples_per_s"]:
            fig[f"world {w} ddp samples/s"] = statistics.median(per["samples_per_s"]["ddp"])
            fig[f"world {w} elastic/ddp"] = statistics.median(
                e / d for e, d in zip(per["samples_per_s"]["elastic"], per["samples_per_s"]["ddp"], strict=True)
            )
    if "recovery" in row:
        fig["recovery_s"] = statistics.median(r["recovery_s"] for r in row["recovery"]["rows"])
        fig["reset_s"] = statistics.median(r["reset_s"] for r in row["recovery"]["rows"])
    return fig


def describe(row: dict[str, Any], worlds: list[int]) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in round_figures(row, worlds).items())


def summarize(rounds: list[dict[str, Any]], worlds: list[int]) -> dict[str, dict[str, Any]]:
    figs = [(r["version"], round_figures(r, worlds)) for r in rounds]
    summary = {}
    for key in figs[0][1]:
        per = {v: [f[key] for version, f in figs if version == v] for v in ("before", "after")}
        med = {v: statistics.median(xs) for v, xs in per.items()}
        summary[key] = {**med, "ratio": med["after"] / med["before"], "rounds": per}
    return summary


if __name__ == "__main__":
    main()
