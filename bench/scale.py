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

Each repetition is one run (up, then down). Prints a table and writes
bench/results/scale.json. Reports, never asserts.

    .venv/bin/python bench/scale.py [--reps 3]
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
from ray.cluster_utils import Cluster
from results_file import write_results

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
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)
    progress, stop = config["progress"], config["stop"]

    @elastic.run
    def train(state) -> int:
        g = torch.Generator().manual_seed(elastic.rank())
        while not os.path.exists(stop) and state.step < config["max_steps"]:
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
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
    metrics = result.metrics
    first4 = next(i for i, m in enumerate(metrics) if m["world_size"] == 4)
    first2 = next(i for i, m in enumerate(metrics) if i > first4 and m["world_size"] == 2)
    return {
        "up_first_step_s": times[first4] - t_offered,
        "up_pause_s": longest_gap(times, t_offered, times[first4] + 1),
        "up_steps_lost": metrics[first4 - 1]["step"] - (metrics[first4]["step"] - 1),
        "down_to_world2_s": times[first2] - t_withdrawn,
        "down_pause_s": longest_gap(times, t_withdrawn, times[first2] + 1),
        "down_steps_lost": metrics[first2 - 1]["step"] - (metrics[first2]["step"] - 1),
        "events": [(e.kind, e.world_size, e.reset_duration) for e in result.events],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for rep in range(args.reps):
            # a fresh cluster per repetition: a second run on a cluster that lost a node did not start in 180 s
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
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
    summary = {
        k: statistics.median(r[k] for r in rows)
        for k in ("up_first_step_s", "up_pause_s", "up_steps_lost", "down_to_world2_s", "down_pause_s")
    }
    summary["down_steps_lost_max"] = max(r["down_steps_lost"] for r in rows)
    summary["up_pause_max_s"] = max(r["up_pause_s"] for r in rows)
    summary["down_pause_max_s"] = max(r["down_pause_s"] for r in rows)
    print("median over reps: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    write_results("scale", rows, reps=args.reps, summary=summary)


if __name__ == "__main__":
    main()
