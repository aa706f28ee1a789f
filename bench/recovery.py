"""Recovery: SIGKILL one of 4 workers, time until the survivors complete a step.

On a local multi-node cluster (a head without CPUs and 2 nodes of 2 CPUs),
4 workers train a small MLP with `TorchState` + `DistributedOptimizer`,
committing every 10 steps. In each repetition one worker (random rank,
random step, seeded) SIGKILLs itself right after its step; the survivors'
next completed step is read from rank 0's reports. Steps lost is how many
completed steps the rollback to the last commit undid.

Prints p50/p95/max and writes bench/results/recovery.json. Reports, never
asserts. (Ray Train v2 beside it is issue 6's next step.)

    .venv/bin/python bench/recovery.py [--reps 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results_file import write_results

import ray_elastic as elastic

COMMIT_EVERY = 10


class KillOnce:
    """Step hook: the chosen rank SIGKILLs itself after `step`, once (a marker file records when)."""

    def __init__(self, rank: int, step: int, marker: str) -> None:
        self.rank, self.step, self.marker = rank, step, marker

    def __call__(self, step: int) -> None:
        if step != self.step or elastic.rank() != self.rank:
            return
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"time": time.time(), "step": step}))
        os.kill(os.getpid(), signal.SIGKILL)


def train_fn(config: dict) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)
    hook = config["hook"]

    @elastic.run
    def train(state) -> int:
        g = torch.Generator().manual_seed(elastic.rank())
        while state.step < config["steps"]:
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            elastic.report({"step": state.step, "world_size": elastic.size()})
            hook(state.step)
            time.sleep(0.005)  # stands for more compute per step
            if state.step % COMMIT_EVERY == 0:
                state.commit()
            else:
                state.check_host_updates()
        return state.step

    return train(state)


def one_rep(rng: random.Random, workdir: str, rep: int) -> dict:
    kill_step = rng.randint(30, 120)
    kill_rank = rng.randint(0, 3)
    marker = os.path.join(workdir, f"killed-{rep}")
    result = elastic.ElasticTrainer(
        train_fn,
        min_workers=2,
        max_workers=4,
        config={"steps": kill_step + 60, "hook": KillOnce(kill_rank, kill_step, marker)},
        cooldown_range=(60, 60),
        verbose=0,
    ).fit()
    killed = json.loads(Path(marker).read_text())
    after = [(t, m) for t, m in zip(result.metric_times, result.metrics, strict=True) if t > killed["time"]]
    t_next, m_next = next((t, m) for t, m in after if m["world_size"] == 3)
    resumed_from = m_next["step"] - 1
    return {
        "kill_rank": kill_rank,
        "kill_step": kill_step,
        "recovery_s": t_next - killed["time"],
        "steps_lost": kill_step - resumed_from,
        "reset_s": next(e.reset_duration for e in result.events if e.kind == "worker_failed"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    cluster.wait_for_nodes()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for rep in range(args.reps):
            row = one_rep(rng, workdir, rep)
            rows.append(row)
            print(
                f"rep {rep}: rank {row['kill_rank']} killed after step {row['kill_step']}: next step after "
                f"{row['recovery_s']:.3f} s (reset {row['reset_s']:.3f} s), {row['steps_lost']} steps redone",
                flush=True,
            )
    ray.shutdown()
    cluster.shutdown()
    rec = sorted(r["recovery_s"] for r in rows)
    summary = {
        "p50_s": statistics.median(rec),
        "p95_s": rec[min(len(rec) - 1, round(0.95 * (len(rec) - 1)))],
        "max_s": rec[-1],
        "median_steps_lost": statistics.median(r["steps_lost"] for r in rows),
    }
    print(
        f"ray-elastic, 4 -> 3 workers: recovery p50 {summary['p50_s']:.3f} s, p95 {summary['p95_s']:.3f} s, "
        f"max {summary['max_s']:.3f} s; median steps redone {summary['median_steps_lost']}"
    )
    write_results("recovery", rows, reps=args.reps, seed=args.seed, summary=summary)


if __name__ == "__main__":
    main()
