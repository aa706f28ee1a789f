"""Recovery: SIGKILL one of 4 workers, time until the survivors complete a step.

On a local multi-node cluster (a head without CPUs and 2 nodes of 2 CPUs),
4 workers train a small MLP with `TorchState` + `DistributedOptimizer`,
committing every 10 steps. In each repetition one worker (random rank,
random step, seeded) SIGKILLs itself right after its step; the survivors'
next completed step is read from rank 0's reports. Steps lost is how many
completed steps the rollback to the last commit undid. Each repetition runs
twice, the same kill each time: with `DistributedOptimizer` and with
`prepare_model` (DDP) and a plain optimizer (`--no-ddp` skips the second).

Scale-up and graceful removal with both paths (`--scale-reps`, default 2 per
path): on the same cluster, discovery (a file of `{node id: slots}`, polled
every second) first offers one node, so 2 workers train; then it offers the
second node (already up: the newcomers' actor start and imports count, a
node's start does not), and later withdraws it again. Measured as
`bench/scale.py` measures: from the offer to the first step at world size 4,
the survivors' longest gap between two steps around it, and for the removal
the steps lost and the pause. The same loop and kill as above otherwise.

Ray Train v2 beside it, on the same cluster, same model, same kill, measured
the same way: `TorchTrainer` (4 workers, DDP) with
`FailureConfig(max_failures=3)` and a checkpoint every `--rt-every` steps;
after the kill it restarts every worker and resumes from the last
checkpoint. Fewer repetitions (`--rt-reps`): each takes tens of seconds.

A large model beside them (`--large-reps`, default 3): a 25.1M-parameter
MLP (tests/support/workloads.py `large_model_train_fn`, gradients in several
buckets) where rank 2, which is not a ring neighbour of rank 0, SIGKILLs
itself in the middle of backward with buckets in flight.

Prints p50/p95/max and writes bench/results/recovery.json. Reports, never
asserts.

    .venv/bin/python bench/recovery.py [--reps 10] [--scale-reps 2] [--rt-reps 3] [--large-reps 3] [--seed 0]
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
import threading
import time
from pathlib import Path

import torch
from own_dashboard import own_dashboard
from results_file import write_results
from scale import FileDiscovery, longest_gap, wait_progress
from small_mlp import make_mlp, raytrain_checkpoint, raytrain_resume, sgd_step

import ray_elastic as elastic

COMMIT_EVERY = 10


class KillOnce:
    """Step hook: the chosen rank SIGKILLs itself after `step`, once (a marker file records when)."""

    def __init__(self, rank: int, step: int, marker: str) -> None:
        self.rank, self.step, self.marker = rank, step, marker

    def __call__(self, step: int) -> None:
        if step == self.step and elastic.rank() == self.rank:
            self.fire(step)

    def fire(self, step: int) -> None:
        """Kill this process now, unless the marker says it already happened (for loops that check themselves)."""
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
    if config.get("ddp"):
        model = elastic.torch.prepare_model(make_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        model = make_mlp()
        opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)
    hook = config.get("hook") or (lambda step: None)

    @elastic.run
    def train(state) -> int:
        g = torch.Generator().manual_seed(elastic.rank())
        while state.step < config["steps"]:
            # the ranks agree on stopping (rank 0's view), so none leaves the ring alone
            if config.get("stop") and state.step % 10 == 0 and elastic.broadcast_object(os.path.exists(config["stop"])):
                break
            sgd_step(model, opt, g)
            state.step += 1
            elastic.report({"step": state.step, "world_size": elastic.size()})
            if config.get("progress") and elastic.rank() == 0 and state.step % 10 == 0:
                Path(config["progress"]).write_text(json.dumps({"step": state.step, "world_size": elastic.size()}))
            hook(state.step)
            time.sleep(config.get("step_time", 0.005))  # stands for more compute per step
            if state.step % COMMIT_EVERY == 0:
                state.commit()
            else:
                state.check_host_updates()
        return state.step

    return train(state)


def one_rep(kill_rank: int, kill_step: int, workdir: str, rep: int, ddp: bool = False) -> dict:
    marker = os.path.join(workdir, f"killed-{rep}{'-ddp' if ddp else ''}")
    result = elastic.ElasticTrainer(
        train_fn,
        min_workers=2,
        max_workers=4,
        config={"steps": kill_step + 20, "hook": KillOnce(kill_rank, kill_step, marker), "ddp": ddp},
        cooldown_range=(60, 60),
        verbose=0,
    ).fit()
    killed = json.loads(Path(marker).read_text())
    after = [(t, m) for t, m in zip(result.metric_times, result.metrics_history, strict=True) if t > killed["time"]]
    # the survivors' first step at 3; if there is none (the killed host's cool-down ended first, so the
    # survivors resumed at 4), the first step after the kill that went back (the rollback), at any size
    pairs = list(zip(after, after[1:], strict=False))
    rolled_back = next(((t, m) for (_, prev), (t, m) in pairs if m["step"] <= prev["step"]), after[-1])
    t_next, m_next = next(((t, m) for t, m in after if m["world_size"] == 3), rolled_back)
    resumed_from = m_next["step"] - 1
    return {
        "kill_rank": kill_rank,
        "kill_step": kill_step,
        "recovery_s": t_next - killed["time"],
        "steps_lost": kill_step - resumed_from,
        "world_after": m_next["world_size"],
        "reset_s": next(e.reset_duration for e in result.events if e.kind == "worker_failed"),
    }


def scale_rep(nodes: list[str], workdir: str, rep: int, ddp: bool) -> dict:
    """2 workers on the first node; the second node offered (scale-up to 4), then withdrawn (graceful removal)."""
    tag = f"{rep}{'-ddp' if ddp else ''}"
    hosts_file = os.path.join(workdir, f"hosts-{tag}.json")
    progress, stop = os.path.join(workdir, f"progress-{tag}"), os.path.join(workdir, f"stop-{tag}")
    Path(hosts_file).write_text(json.dumps({nodes[0]: 2}))
    trainer = elastic.ElasticTrainer(
        train_fn,
        min_workers=2,
        max_workers=4,
        config={"steps": 20_000, "ddp": ddp, "progress": progress, "stop": stop},
        discovery=FileDiscovery(hosts_file),
        discovery_interval=1,
        verbose=0,
    )
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()), daemon=True)
    runner.start()
    wait_progress(progress, "2 workers training", lambda p: p["step"] >= 50)
    Path(hosts_file).write_text(json.dumps({nodes[0]: 2, nodes[1]: 2}))
    t_offered = time.time()
    seen = wait_progress(progress, "the world to grow to 4", lambda p: p["world_size"] == 4)
    wait_progress(progress, "steady steps at 4", lambda p, s=seen["step"]: p["step"] >= s + 50)
    Path(hosts_file).write_text(json.dumps({nodes[0]: 2}))
    t_withdrawn = time.time()
    seen = wait_progress(progress, "the world to shrink to 2", lambda p: p["world_size"] == 2)
    wait_progress(progress, "steady steps at 2", lambda p, s=seen["step"]: p["step"] >= s + 30)
    Path(stop).touch()
    runner.join(120)
    result = box["result"]
    times, metrics = result.metric_times, result.metrics_history
    first4 = next(i for i, m in enumerate(metrics) if m["world_size"] == 4)
    first2 = next(i for i, m in enumerate(metrics) if i > first4 and m["world_size"] == 2)
    return {
        "up_first_step_s": times[first4] - t_offered,
        "up_pause_s": longest_gap(times, t_offered, times[first4] + 1),
        "up_steps_lost": metrics[first4 - 1]["step"] - (metrics[first4]["step"] - 1),
        "down_to_world2_s": times[first2] - t_withdrawn,
        "down_pause_s": longest_gap(times, t_withdrawn, times[first2] + 1),
        "down_steps_lost": metrics[first2 - 1]["step"] - (metrics[first2]["step"] - 1),
        "events": [(e.kind, e.world_size, e.reset_duration, e.detail) for e in result.events],
    }


SCALE_KEYS = ("up_first_step_s", "up_pause_s", "up_steps_lost", "down_to_world2_s", "down_pause_s", "down_steps_lost")


def raytrain_train_fn(config: dict) -> None:
    """Ray Train's loop: the same MLP under DDP, a checkpoint every `every` steps, rank 0 logs each step.

    Each log line carries the times of this entry's stages: the loop entered,
    the model prepared, the checkpoint loaded (and, with `config["elastic"]`,
    `ray_elastic.train`'s own marks of the re-entry): after a kill, the first
    step of a loop entered later is where training went on
    (bench/ray_train_recovery.py runs this loop under both TorchTrainers).
    """
    import ray.train
    import ray.train.torch

    entered = time.time()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(make_mlp())
    prepared = time.time()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = raytrain_resume(model, opt)
    marks = {"entered": entered, "prepared": prepared, "resumed": time.time()}
    if config.get("elastic"):  # the session's marks of this entry (rejoined, collected, settled)
        from ray_elastic.train.session import current_session

        marks |= current_session("train_fn").marks
    g = torch.Generator().manual_seed(rank)
    while step < config["steps"]:
        sgd_step(model, opt, g)
        step += 1
        if rank == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps({"time": time.time(), "step": step, **marks}) + "\n")
        if rank == config["kill_rank"] and step == config["kill_step"]:
            KillOnce(rank, step, config["marker"]).fire(step)
        time.sleep(0.005)
        if step % config["every"] == 0:
            raytrain_checkpoint(model, opt, step, rank)


def raytrain_rep(rng: random.Random, workdir: str, rep: int, every: int) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    kill_step = rng.randint(30, 120)
    kill_rank = rng.randint(0, 3)
    marker, log = os.path.join(workdir, f"rt-killed-{rep}"), os.path.join(workdir, f"rt-log-{rep}")
    config = {
        "steps": kill_step + 20,
        "every": every,
        "kill_step": kill_step,
        "kill_rank": kill_rank,
        "marker": marker,
        "log": log,
    }
    TorchTrainer(
        raytrain_train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=4),
        run_config=RunConfig(
            name=f"rt-recovery-{rep}",
            storage_path=os.path.join(workdir, "rt-storage"),
            failure_config=FailureConfig(max_failures=3),
        ),
    ).fit()
    killed = json.loads(Path(marker).read_text())
    steps = [json.loads(line) for line in Path(log).read_text().splitlines()]
    # the restarted group's first step is the first one after the kill that does not go forward
    # (rank 0 may still log the killed step itself just after the kill)
    first = next(
        cur
        for prev, cur in zip(steps, steps[1:], strict=False)
        if cur["time"] > killed["time"] and cur["step"] <= prev["step"]
    )
    return {
        "kill_rank": kill_rank,
        "kill_step": kill_step,
        "recovery_s": first["time"] - killed["time"],
        "steps_lost": kill_step - (first["step"] - 1),
    }


def large_rep(workdir: str, rep: int) -> dict:
    """The 25.1M-parameter model, 4 workers; rank 2 dies mid-backward at step 5."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
    from workloads import large_model_train_fn

    marker = os.path.join(workdir, f"large-killed-{rep}")
    config = {"steps": 9, "kill_step": 5, "kill_rank": 2, "marker": marker}
    result = elastic.ElasticTrainer(
        large_model_train_fn, 2, 4, config=config, cooldown_range=(600, 600), verbose=0
    ).fit()
    killed = json.loads(Path(marker).read_text())
    t_next = next(t for t, m in zip(result.metric_times, result.metrics_history, strict=True) if t > killed["time"])
    return {
        "kill_rank": 2,
        "kill_step": killed["step"],
        "recovery_s": t_next - killed["time"],
        "steps_lost": 0,
        "reset_s": next(e.reset_duration for e in result.events if e.kind == "worker_failed"),
    }


def summarize(rows: list[dict]) -> dict:
    rec = sorted(r["recovery_s"] for r in rows)
    return {
        "p50_s": statistics.median(rec),
        "p95_s": rec[min(len(rec) - 1, round(0.95 * (len(rec) - 1)))],
        "max_s": rec[-1],
        "median_steps_lost": statistics.median(r["steps_lost"] for r in rows),
        "reps": len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rt-reps", type=int, default=3, help="Ray Train repetitions (0 to skip)")
    parser.add_argument("--rt-every", type=int, default=50, help="Ray Train: steps between checkpoints")
    parser.add_argument("--large-reps", type=int, default=3, help="25.1M-parameter repetitions (0 to skip)")
    parser.add_argument("--scale-reps", type=int, default=2, help="scale-up + removal repetitions per path (0 to skip)")
    parser.add_argument("--no-ddp", action="store_true", help="skip the prepare_model (DDP) repetitions")
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **own_dashboard()})
    nodes = [cluster.add_node(num_cpus=2).node_id for _ in range(2)]
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    cluster.wait_for_nodes()
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        ddp_rows = []
        for rep in range(args.reps):
            kill_step, kill_rank = rng.randint(30, 120), rng.randint(0, 3)
            for ddp in (False,) if args.no_ddp else (False, True):
                row = one_rep(kill_rank, kill_step, workdir, rep, ddp)
                (ddp_rows if ddp else rows).append(row)
                print(
                    f"rep {rep}{' (DDP)' if ddp else ''}: rank {row['kill_rank']} killed after step "
                    f"{row['kill_step']}: next step after {row['recovery_s']:.3f} s (reset {row['reset_s']:.3f} s), "
                    f"{row['steps_lost']} steps redone",
                    flush=True,
                )
        scale_rows: dict[str, list[dict]] = {"optimizer": [], "ddp": []}
        for rep in range(args.scale_reps):
            for ddp in (False,) if args.no_ddp else (False, True):
                row = scale_rep(nodes, workdir, rep, ddp)
                scale_rows["ddp" if ddp else "optimizer"].append(row)
                print(
                    f"scale rep {rep}{' (DDP)' if ddp else ''}: up: first step at 4 after "
                    f"{row['up_first_step_s']:.2f} s, pause {row['up_pause_s']:.3f} s, "
                    f"{row['up_steps_lost']} steps lost; down: at 2 after "
                    f"{row['down_to_world2_s']:.2f} s, pause {row['down_pause_s']:.3f} s, "
                    f"{row['down_steps_lost']} steps lost",
                    flush=True,
                )
        large_rows = []
        for rep in range(args.large_reps):
            row = large_rep(workdir, rep)
            large_rows.append(row)
            print(
                f"25.1M parameters, rep {rep}: rank 2 killed mid-backward: next step after {row['recovery_s']:.3f} s "
                f"(reset {row['reset_s']:.3f} s)",
                flush=True,
            )
        rt_rows = []
        rt_rng = random.Random(args.seed)
        for rep in range(args.rt_reps):
            row = raytrain_rep(rt_rng, workdir, rep, args.rt_every)
            rt_rows.append(row)
            print(
                f"Ray Train rep {rep}: rank {row['kill_rank']} killed after step {row['kill_step']}: next step "
                f"after {row['recovery_s']:.3f} s, {row['steps_lost']} steps redone",
                flush=True,
            )
    ray.shutdown()
    cluster.shutdown()
    summary = summarize(rows)
    print(
        f"ray-elastic, 4 -> 3 workers: recovery p50 {summary['p50_s']:.3f} s, p95 {summary['p95_s']:.3f} s, "
        f"max {summary['max_s']:.3f} s; median steps redone {summary['median_steps_lost']}"
    )
    ddp_summary = summarize(ddp_rows) if ddp_rows else None
    if ddp_summary:
        print(
            f"ray-elastic with prepare_model (DDP), 4 -> 3 workers: recovery p50 {ddp_summary['p50_s']:.3f} s, "
            f"p95 {ddp_summary['p95_s']:.3f} s, max {ddp_summary['max_s']:.3f} s; median steps redone "
            f"{ddp_summary['median_steps_lost']}"
        )
    scale_summary = {
        path: {k: statistics.median(r[k] for r in path_rows) for k in SCALE_KEYS}
        | {"up_pause_max_s": max(r["up_pause_s"] for r in path_rows), "reps": len(path_rows)}
        for path, path_rows in scale_rows.items()
        if path_rows
    }
    for path, sm in scale_summary.items():
        print(f"scale-up and removal, {path}, median over reps: " + ", ".join(f"{k} {v:.3f}" for k, v in sm.items()))
    large_summary = summarize(large_rows) if large_rows else None
    if large_summary:
        print(
            f"ray-elastic, 25.1M parameters, rank 2 of 4 killed mid-backward: recovery p50 "
            f"{large_summary['p50_s']:.3f} s, max {large_summary['max_s']:.3f} s"
        )
    rt_summary = summarize(rt_rows) if rt_rows else None
    if rt_summary:
        print(
            f"Ray Train v2, 4 workers restarted, checkpoint every {args.rt_every}: recovery p50 "
            f"{rt_summary['p50_s']:.3f} s, max {rt_summary['max_s']:.3f} s; median steps redone "
            f"{rt_summary['median_steps_lost']}; p50 ratio {rt_summary['p50_s'] / summary['p50_s']:.0f}x ours"
        )
    write_results(
        "recovery",
        rows,
        reps=args.reps,
        seed=args.seed,
        summary=summary,
        raytrain_rows=rt_rows,
        raytrain_summary=rt_summary,
        raytrain_checkpoint_every=args.rt_every,
        large_rows=large_rows,
        large_summary=large_summary,
        ddp_rows=ddp_rows,
        ddp_summary=ddp_summary,
        scale_rows=scale_rows,
        scale_summary=scale_summary,
    )


if __name__ == "__main__":
    main()
