"""The frame `bench/lightning.py` and `bench/transformers.py` share: ray-elastic beside Ray Train on one loop.

Each of those scripts brings its training functions and three measurements
(a ray-elastic recovery, a Ray Train recovery, a throughput round at one
world size); this module parses the common options, runs them on one local
cluster with the same seeded kills for both systems, prints the tables and
writes `bench/results/<name>.json`.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import step_log
from own_dashboard import local_cluster
from results_file import write_results

# how `--commit-every` reaches the training functions: the cluster's processes inherit this process's environment
COMMIT_EVERY_ENV = "BENCH_COMMIT_EVERY"


def throughput_row(world: int, steps: int, batch: int, rates: dict[str, list[float]]) -> dict[str, Any]:
    """One world size's figures from interleaved rounds of steps/s: medians and the spread of the ratios."""
    ratios = [e / d for e, d in zip(rates["elastic"], rates["ddp"], strict=True)]
    return {
        "world": world,
        "steps": steps,
        "elastic_steps_per_s": statistics.median(rates["elastic"]),
        "ddp_steps_per_s": statistics.median(rates["ddp"]),
        "elastic_samples_per_s": statistics.median(rates["elastic"]) * batch * world,
        "ddp_samples_per_s": statistics.median(rates["ddp"]) * batch * world,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "elastic_rounds": rates["elastic"],
        "ddp_rounds": rates["ddp"],
    }


def compare(
    name: str,
    labels: tuple[str, str],
    elastic_rep: Callable[[dict, dict[str, int], str, int], dict],
    raytrain_rep: Callable[[dict, int, str, int], dict],
    throughput: Callable[[int, int, int, str], dict],
    *,
    commit_every: int,
    default_steps: int,
    **meta: Any,
) -> None:
    """Parse the options, measure, print and write `bench/results/<name>.json` (`--out` names another file).

    `labels`: how the recovery table names ray-elastic's and Ray Train's rows.
    """
    parser = argparse.ArgumentParser(description=f"{name}: ray-elastic beside Ray Train")
    parser.add_argument("--reps", type=int, default=3, help="ray-elastic recovery repetitions")
    parser.add_argument("--rt-reps", type=int, default=2, help="Ray Train recovery repetitions (0 to skip)")
    parser.add_argument("--rt-every", type=int, default=commit_every, help="Ray Train: steps between checkpoints")
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds (0 to skip)")
    parser.add_argument("--steps", type=int, default=default_steps, help="timed steps per throughput window")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=name, help="the results file's name under bench/results/")
    # what costs ray-elastic its throughput, switched off one at a time (the cluster's processes inherit them)
    parser.add_argument("--commit-every", type=int, default=commit_every, help="ray-elastic: steps between commits")
    parser.add_argument("--no-shm", action="store_true", help="ray-elastic: Gloo's sums, not shared memory's")
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ[COMMIT_EVERY_ENV] = str(args.commit_every)
    if args.no_shm:
        os.environ["RAY_ELASTIC_SHM_ALLREDUCE"] = "0"
    rng = random.Random(args.seed)
    kills = [{"rank": rng.randint(0, 3), "step": rng.randint(25, 55)} for _ in range(max(args.reps, args.rt_reps))]
    el_rows, rt_rows, tput_rows = [], [], []
    load_before, started = os.getloadavg(), time.monotonic()
    with local_cluster(nodes=2, cpus=4) as (_, nodes), tempfile.TemporaryDirectory() as workdir:
        slots = {node.node_id: 2 for node in nodes}
        for rep in range(args.reps):
            row = elastic_rep(kills[rep], slots, workdir, rep)
            el_rows.append(row)
            print(
                f"ray-elastic rep {rep}: rank {row['kill_rank']} killed after step {row['kill_step']}: next step "
                f"after {row['recovery_s']:.3f} s at world {row['world_after']} (reset {row['reset_s']:.3f} s), "
                f"{row['steps_redone']} steps redone",
                flush=True,
            )
        for rep in range(args.rt_reps):
            row = raytrain_rep(kills[rep], args.rt_every, workdir, rep)
            rt_rows.append(row)
            print(
                f"Ray Train rep {rep}: rank {row['kill_rank']} killed after step {row['kill_step']}: next step "
                f"after {row['recovery_s']:.3f} s at world {row['world_after']}, {row['steps_redone']} steps redone",
                flush=True,
            )
        if args.rounds:
            for world in (int(w) for w in args.worlds.split(",")):
                tput_rows.append(throughput(world, args.rounds, args.steps, workdir))
    load_after, wall_s = os.getloadavg(), time.monotonic() - started
    print(f"{wall_s:.0f} s; load average (1, 5, 15 min) before {load_before}, after {load_after}")
    el_summary = step_log.summarize(el_rows) if el_rows else None
    rt_summary = step_log.summarize(rt_rows) if rt_rows else None
    width = max(len(labels[0]), len(labels[1]) + 20)
    print(f"{'recovery, SIGKILL 1 of 4':<{width}} {'reps':>4} {'p50 s':>8} {'max s':>8} {'steps redone':>12}")
    for label, sm in ((labels[0], el_summary), (f"{labels[1]}, ckpt every {args.rt_every}", rt_summary)):
        if sm:
            print(
                f"{label:<{width}} {sm['reps']:>4} {sm['p50_s']:>8.3f} {sm['max_s']:>8.3f} "
                f"{sm['median_steps_redone']:>12}"
            )
    if tput_rows:
        print(f"{'world':>5} {'elastic steps/s':>15} {'DDP steps/s':>11} {'ratio':>6} {'min':>6} {'max':>6}")
        for r in tput_rows:
            print(
                f"{r['world']:>5} {r['elastic_steps_per_s']:>15.1f} {r['ddp_steps_per_s']:>11.1f} "
                f"{r['ratio']:>6.3f} {r['ratio_min']:>6.3f} {r['ratio_max']:>6.3f}"
            )
    write_results(
        args.out,
        tput_rows,
        **meta,
        commit_every=args.commit_every,
        shm_allreduce=not args.no_shm,
        rounds=args.rounds,
        seed=args.seed,
        elastic_recovery_rows=el_rows,
        elastic_recovery_summary=el_summary,
        raytrain_recovery_rows=rt_rows,
        raytrain_recovery_summary=rt_summary,
        raytrain_checkpoint_every=args.rt_every,
        wall_s=wall_s,
        load_before=load_before,
        load_after=load_after,
    )
