"""Scale-up and graceful scale-down: how long the world takes to change, and what it costs.

On a local multi-node cluster (a head without CPUs, one node of 2 CPUs),
ElasticTrainer(min 2, max 4, `discovery_interval=1`) trains a small MLP with
`TorchState`, committing every 10 steps. Discovery is a callable that reads a
JSON file of `{node id: slots}`, so the benchmark decides when hosts come and
go:

- scale-up: a node of 2 CPUs is added and offered; measured from the moment
  it is offered (after `add_node` returned) to the first step completed at
  world size 4, which includes the newcomers' actor start and imports; and
  the survivors' pause, their longest gap between two steps around the resize;
- graceful scale-down: the node is withdrawn from discovery (still alive, as
  a host announced for removal); steps lost (steps the resize undid: 0 when
  no rollback happens) and the pause.

Each repetition is one run (up, then down).

Ray Train v2's elastic resize beside it (`--rt-reps`), on the same cluster
shape: `TorchTrainer` with `ScalingConfig(num_workers=(2, 4),
elastic_resize_monitor_interval_s=1)` (Ray 2.60's elastic training: the
controller polls Ray's autoscaling coordinator for resources and, when more
workers fit, shuts the worker group down and starts a bigger one that resumes
from the last checkpoint), the same MLP under DDP, a checkpoint every
`--rt-every` steps. Measured the same way: from the node being added to the
first step completed at world size 4, and the longest gap between two steps
of rank 0 around it (every worker is restarted, so this is the whole
restart), plus the steps redone. Ray Train has no graceful scale-down
(removing a node is a failure to it), so only scale-up is compared.

Prints a table and writes bench/results/scale.json. Reports, never asserts.

    .venv/bin/python bench/scale.py [--reps 2] [--rt-reps 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from own_dashboard import own_dashboard
from ray.cluster_utils import Cluster
from results_file import write_results
from small_mlp import make_mlp, raytrain_checkpoint, raytrain_resume, sgd_step

import ray_elastic as elastic


class FileDiscovery:
    """Discovery callable: the hosts are whatever the benchmark wrote into `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> dict[str, int]:
        return json.loads(Path(self.path).read_text())


def train_fn(config: dict) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_mlp()
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)
    progress, stop = config["progress"], config["stop"]

    @elastic.run
    def train(state) -> int:
        g = torch.Generator().manual_seed(elastic.rank())
        while not os.path.exists(stop) and state.step < config["max_steps"]:
            sgd_step(model, opt, g)
            state.step += 1
            elastic.report({"step": state.step, "world_size": elastic.size()})
            if elastic.rank() == 0 and state.step % 10 == 0:
                Path(progress).write_text(json.dumps({"step": state.step, "world_size": elastic.size()}))
            time.sleep(0.01)  # stands for more compute per step
            if state.step % 10 == 0:
                state.commit()
            else:
                state.check_host_updates()
        return state.step

    return train(state)


def wait_progress(path: str, what: str, predicate, timeout: float = 180) -> dict:
    """Wait until rank 0's progress file satisfies `predicate`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            p = json.loads(Path(path).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            p = None
        if p is not None and predicate(p):
            return p
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def longest_gap(times: list[float], start: float, end: float) -> float:
    inside = [t for t in times if start - 1 <= t <= end]
    return max((b - a for a, b in zip(inside, inside[1:], strict=False)), default=float("nan"))


def one_rep(cluster: Cluster, base_node: str, workdir: str, rep: int) -> dict:
    hosts_file = os.path.join(workdir, f"hosts-{rep}.json")
    progress, stop = os.path.join(workdir, f"progress-{rep}"), os.path.join(workdir, f"stop-{rep}")
    Path(hosts_file).write_text(json.dumps({base_node: 2}))
    trainer = elastic.ElasticTrainer(
        train_fn,
        min_workers=2,
        max_workers=4,
        config={"progress": progress, "stop": stop, "max_steps": 20_000},
        discovery=FileDiscovery(hosts_file),
        discovery_interval=1,
        verbose=0,
    )
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()))
    runner.start()
    wait_progress(progress, "2 workers training", lambda p: p["step"] >= 50)
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    Path(hosts_file).write_text(json.dumps({base_node: 2, node.node_id: 2}))
    t_offered = time.time()
    seen = wait_progress(progress, "the world to grow to 4", lambda p: p["world_size"] == 4)
    wait_progress(progress, "steady steps at 4", lambda p, s=seen["step"]: p["step"] >= s + 50)
    Path(hosts_file).write_text(json.dumps({base_node: 2}))
    t_withdrawn = time.time()
    seen = wait_progress(progress, "the world to shrink to 2", lambda p: p["world_size"] == 2)
    wait_progress(progress, "steady steps at 2", lambda p, s=seen["step"]: p["step"] >= s + 30)
    Path(stop).touch()
    runner.join(120)
    cluster.remove_node(node)
    result = box["result"]
    times = result.metric_times
    metrics = result.metrics_history
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


def raytrain_train_fn(config: dict) -> None:
    """Ray Train's loop: the same MLP under DDP; rank 0 logs every step; a checkpoint every `every` steps."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    model = ray.train.torch.prepare_model(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = raytrain_resume(model, opt)
    g = torch.Generator().manual_seed(rank)
    while not os.path.exists(config["stop"]) and step < config["max_steps"]:
        sgd_step(model, opt, g)
        step += 1
        if rank == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps({"time": time.time(), "step": step, "world_size": world}) + "\n")
        time.sleep(0.01)
        if step % config["every"] == 0:
            raytrain_checkpoint(model, opt, step, rank)


def read_log(path: str) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def wait_log(path: str, what: str, predicate, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not predicate(read_log(path)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def raytrain_rep(workdir: str, rep: int, every: int, timeout: float) -> dict:
    """Ray Train v2's elastic scale-up from 2 to 4 workers when a node of 2 CPUs is added."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **own_dashboard()})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    cluster.wait_for_nodes()
    log, stop = os.path.join(workdir, f"rt-log-{rep}"), os.path.join(workdir, f"rt-stop-{rep}")
    trainer = TorchTrainer(
        raytrain_train_fn,
        train_loop_config={"log": log, "stop": stop, "every": every, "max_steps": 20_000},
        scaling_config=ScalingConfig(num_workers=(2, 4), elastic_resize_monitor_interval_s=1.0),
        run_config=RunConfig(name=f"rt-scale-{rep}", storage_path=os.path.join(workdir, "rt-storage")),
    )
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()), daemon=True)
    runner.start()
    try:
        wait_log(log, "Ray Train's 2 workers training", lambda steps: len(steps) >= 50)
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        t_offered = time.time()
        try:
            wait_log(log, "Ray Train to grow to 4 workers", lambda s: any(e["world_size"] == 4 for e in s), timeout)
            resized = True
        except TimeoutError:
            resized = False
        if resized:
            wait_log(log, "steady steps at 4", lambda s: sum(e["world_size"] == 4 for e in s) >= 30)
        Path(stop).touch()
        runner.join(120)
    finally:
        ray.shutdown()
        cluster.shutdown()
    steps = read_log(log)
    if not resized:
        at2 = [e for e in steps if e["time"] > t_offered]
        return {
            "resized": False,
            "waited_s": timeout,
            "steps_at_2_after_offer": len(at2),
            "note": f"no step at world size 4 within {timeout:g} s of the node being added",
        }
    i4 = next(i for i, e in enumerate(steps) if e["world_size"] == 4)
    times = [e["time"] for e in steps]
    return {
        "resized": True,
        "up_first_step_s": times[i4] - t_offered,
        "up_pause_s": longest_gap(times, t_offered, times[i4] + 1),
        "up_steps_lost": steps[i4 - 1]["step"] - (steps[i4]["step"] - 1),
        # the last step of the old group: roughly when the controller decided to resize and shut it down
        "up_decided_s": times[i4 - 1] - t_offered,
        "checkpoint_every": every,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--rt-reps", type=int, default=1, help="Ray Train repetitions (0 to skip)")
    parser.add_argument("--rt-every", type=int, default=50, help="Ray Train: steps between checkpoints")
    parser.add_argument("--rt-timeout", type=float, default=120, help="Ray Train: how long to wait for the resize")
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for rep in range(args.reps):
            # a fresh cluster per repetition: a second run on a cluster that lost a node did not start in 180 s
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
            base = cluster.add_node(num_cpus=2)
            ray.init(address=cluster.address, logging_level=logging.ERROR)
            cluster.wait_for_nodes()
            try:
                row = one_rep(cluster, base.node_id, workdir, rep)
            finally:
                ray.shutdown()
                cluster.shutdown()
            rows.append(row)
            print(
                f"rep {rep}: up: first step at 4 after {row['up_first_step_s']:.2f} s, pause "
                f"{row['up_pause_s']:.3f} s, {row['up_steps_lost']} steps lost; down: at 2 after "
                f"{row['down_to_world2_s']:.2f} s, pause {row['down_pause_s']:.3f} s, "
                f"{row['down_steps_lost']} steps lost",
                flush=True,
            )
        rt_rows = []
        for rep in range(args.rt_reps):
            row = raytrain_rep(workdir, rep, args.rt_every, args.rt_timeout)
            rt_rows.append(row)
            if row["resized"]:
                print(
                    f"Ray Train rep {rep}: up: first step at 4 after {row['up_first_step_s']:.2f} s, pause "
                    f"{row['up_pause_s']:.3f} s, {row['up_steps_lost']} steps redone",
                    flush=True,
                )
            else:
                print(f"Ray Train rep {rep}: {row['note']}", flush=True)
    summary = {}
    if rows:
        summary = {
            k: statistics.median(r[k] for r in rows)
            for k in ("up_first_step_s", "up_pause_s", "up_steps_lost", "down_to_world2_s", "down_pause_s")
        }
        summary["down_steps_lost_max"] = max(r["down_steps_lost"] for r in rows)
        summary["up_pause_max_s"] = max(r["up_pause_s"] for r in rows)
        summary["down_pause_max_s"] = max(r["down_pause_s"] for r in rows)
        print("median over reps: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    resized = [r for r in rt_rows if r["resized"]]
    rt_summary = {}
    if resized:
        rt_summary = {
            k: statistics.median(r[k] for r in resized)
            for k in ("up_first_step_s", "up_pause_s", "up_steps_lost", "up_decided_s")
        }
        print("Ray Train, median over reps: " + ", ".join(f"{k} {v:.3f}" for k, v in rt_summary.items()))
        if summary:
            print(
                f"Ray Train / ray-elastic: newcomer's first step "
                f"{rt_summary['up_first_step_s'] / summary['up_first_step_s']:.1f}x, survivors' pause "
                f"{rt_summary['up_pause_s'] / summary['up_pause_s']:.0f}x"
            )
    write_results("scale", rows, reps=args.reps, summary=summary, raytrain_rows=rt_rows, raytrain_summary=rt_summary)


if __name__ == "__main__":
    main()
