"""Ray Train's TorchTrainer and `ray_elastic.train`'s, side by side on one script: a SIGKILL's cost.

One training loop in Ray Train v2's documented shape (bench/recovery.py's
`raytrain_train_fn`, which logs the times of each entry's stages; `ray.train.torch.prepare_model`,
`ray.train.get_checkpoint()` at the top, `ray.train.report(...,
checkpoint=...)` every `--every` steps, rank 0 writing the checkpoint), the
small MLP of the other benchmarks. It runs under `ray.train.torch.TorchTrainer`
(4 workers, `FailureConfig(max_failures=3)`: a failure restarts the whole
group from the last checkpoint) and under `ray_elastic.train.torch.TorchTrainer`
(`num_workers=(3, 4)`: the survivors re-enter the loop in their processes),
the loop unchanged: inside the elastic workers the fully qualified calls reach
the elastic ones. In each repetition rank 1 SIGKILLs itself after a seeded
random step; measured from the kill to rank 0's first step in a loop entered
after it, and the steps redone (trained again after the rollback to the last
checkpoint).

On a local cluster: a head without CPUs and 2 nodes of 2 CPUs. Needs
`ray[train]` (the `bench` extra). Prints the medians and writes
bench/results/ray_train_recovery.json. Reports, never asserts.

    .venv/bin/python bench/ray_train_recovery.py [--reps 3] [--every 10] [--seed 0] [--no-ray-train]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from recovery import raytrain_train_fn
from results_file import write_results

# the phases of a re-entry, from the kill to the next step: (name, the mark that ends it)
PHASES = (
    ("unwind", "left"),
    ("rejoin_sync", "called"),
    ("gc", "collected"),
    ("settle", "settled"),
    ("to_loop", "entered"),
    ("prepare_model", "prepared"),
    ("load_checkpoint", "resumed"),
    ("first_step", "time"),
)


def wait_for_free_cpus(cpus: float, timeout: float) -> None:
    """Until the last run's actors released their CPUs: a run started short of a slot measures something else."""
    import ray

    deadline = time.monotonic() + timeout
    while ray.available_resources().get("CPU", 0.0) < cpus:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cluster did not free {cpus} CPUs within {timeout} s: {ray.available_resources()}")
        time.sleep(0.2)


def one_rep(which: str, kill_step: int, every: int, workdir: str, rep: int) -> dict:
    marker, log = os.path.join(workdir, f"{which}-killed-{rep}"), os.path.join(workdir, f"{which}-log-{rep}")
    config = {"steps": kill_step + 30, "every": every, "kill_step": kill_step, "kill_rank": 1}
    config |= {"marker": marker, "log": log, "elastic": which != "ray_train"}
    if which == "ray_train":
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        workers: int | tuple[int, int] = 4
    else:
        from ray_elastic.train import FailureConfig, RunConfig, ScalingConfig
        from ray_elastic.train.torch import TorchTrainer

        workers = (3, 4)
    wait_for_free_cpus(4, 120)
    result = TorchTrainer(
        raytrain_train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name=f"{which}-{rep}",
            storage_path=os.path.join(workdir, "storage"),
            failure_config=FailureConfig(max_failures=3),
        ),
    ).fit()
    killed = os.stat(marker).st_mtime
    steps = [json.loads(line) for line in Path(log).read_text().splitlines()]
    first = next(s for s in steps if s["entered"] > killed)
    row = {"recovery_s": first["time"] - killed, "steps_redone": kill_step - (first["step"] - 1)}
    if which != "ray_train":  # the membership events: the world sizes it trained at; the phases
        row["events"] = [f"{e.kind}:{e.world_size}" for e in result.elastic.events]
        row["phases"] = phases(first, killed)
    return row


def phases(first: dict, killed: float) -> dict[str, float]:
    """Rank 0's re-entry: each phase's seconds, from the kill to its first step in the loop."""
    out, start = {}, killed
    for name, mark in PHASES:
        if mark in first:
            out[name] = first[mark] - start
            start = first[mark]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--every", type=int, default=10, help="steps between reports with a checkpoint")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ray-train", action="store_true", help="only ray_elastic.train (results not written)")
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    cluster.wait_for_nodes()
    rng = random.Random(args.seed)
    rows: dict[str, list[dict]] = {"ray_train": [], "ray_elastic_train": []}
    if args.no_ray_train:
        del rows["ray_train"]
    with tempfile.TemporaryDirectory() as workdir:
        for rep in range(args.reps):
            kill_step = rng.randint(25, 60)
            for which, out in rows.items():
                row = one_rep(which, kill_step, args.every, workdir, rep) | {"kill_step": kill_step}
                out.append(row)
                print(
                    f"{which} rep {rep}: rank 1 killed after step {kill_step}: next step after "
                    f"{row['recovery_s']:.3f} s, {row['steps_redone']} steps redone"
                    + ("".join(f", {k} {v:.3f}" for k, v in row["phases"].items()) if "phases" in row else ""),
                    flush=True,
                )
    ray.shutdown()
    cluster.shutdown()
    summary = {
        which: {
            "median_recovery_s": statistics.median(r["recovery_s"] for r in out),
            "max_recovery_s": max(r["recovery_s"] for r in out),
            "median_steps_redone": statistics.median(r["steps_redone"] for r in out),
        }
        for which, out in rows.items()
    }
    for which, s in summary.items():
        print(f"{which}: " + ", ".join(f"{k} {v:.3f}" for k, v in s.items()))
    medians = {
        name: statistics.median(r["phases"].get(name, 0.0) for r in rows["ray_elastic_train"]) for name, _ in PHASES
    }
    summary["ray_elastic_train"]["median_phases_s"] = medians
    print("ray_elastic_train re-entry, median s: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    if args.no_ray_train:
        return
    write_results(
        "ray_train_recovery",
        rows["ray_elastic_train"],
        raytrain_rows=rows["ray_train"],
        summary=summary,
        every=args.every,
        seed=args.seed,
    )


if __name__ == "__main__":
    main()
