"""A newcomer's boot, by phase: from the host's offer to the newcomer's first step, and where the time goes.

On a local multi-node cluster (a head without CPUs, a node of 2 CPUs),
ElasticTrainer(min 2, max 4, `discovery_interval=1`) trains a small MLP with
`TorchState` and `DistributedOptimizer`, committing every 10 steps. Discovery
reads a file of `{node id: slots}`; once 2 workers train, a fresh node of 2
CPUs is added, and when Ray has it, offered: 2 newcomers boot there and join.

Each newcomer stamps its boot as it goes (`ray_elastic.runtime.boot_marks`:
its actor constructor entered and left, `run()` entered, `train_fn`'s payload
unpacked, the run loop entered, the backend imported, WorkerReady told, the
generation that admits it seen, its ring formed, its first sync done); after
its first step its `train_fn` writes them to a file, with that step's end
and its process's start (`/proc`, to 10 ms). The benchmark adds when it
offered the host and when the driver spawned the newcomer (the
`hosts_added` event's time less the boot it names, to 0.1 s), and splits the
boot into phases (`boot_marks.phases`): each phase's median seconds over the
newcomers of every repetition and its share of the median whole boot.

`--variants` runs the same repetitions with the newcomers' environment
changed (`name=VAR=value`), interleaved, side by side in one run: the
variables are set while the fresh node starts, so its raylet, and the
newcomers' processes it starts, inherit them (the first 2 workers' node
does not). `before=PYTHONPATH=/tmp/old` boots the newcomers from another
copy of `ray_elastic` (`git archive <commit> ray_elastic | tar -x -C
/tmp/old`; each row names the copy it ran), so two versions of the
worker's side compare in one run. `profile=PYTHONPROFILEIMPORTTIME=1`
writes each newcomer's imports, timed, to its worker log.

Prints a table per variant and writes bench/results/boot_phases.json.
Reports, never asserts.

    .venv/bin/python bench/boot_phases.py [--reps 5] [--variants before=PYTHONPATH=/tmp/old after] [--out NAME]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray
from own_dashboard import own_dashboard
from ray.cluster_utils import Cluster
from recovery import train_fn
from results_file import write_results
from scale import FileDiscovery, wait_progress

import ray_elastic as elastic
from ray_elastic.runtime import boot_marks, process


class WriteMarksOnce:
    """`recovery.train_fn`'s step hook: after this process's first step (its boot is over), write its marks."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.written = False  # per process: each worker unpickles its own copy

    def __call__(self, step: int) -> None:
        if not self.written:
            self.written = True
            write_marks(self.directory)


def write_marks(directory: str) -> None:
    """This worker's boot marks, its first step's end and its process's start, as `<worker id>.json`."""
    ctx = process.current()
    marks = dict(ctx.boot_marks, first_step=time.time())
    record = {
        "worker_id": ctx.worker_id,
        "marks": marks,
        "process_started": psutil.Process().create_time(),
        "pid": os.getpid(),
        "ray_elastic": os.path.dirname(elastic.__file__),  # which copy this process runs (a variant's PYTHONPATH)
    }
    Path(directory, f"{ctx.worker_id}.json").write_text(json.dumps(record))


def spawn_time(events: list, newcomers: int) -> float | None:
    """When the driver spawned the newcomers: their hosts_added event's time less the boot its detail names."""
    for e in events:
        if e.kind == "hosts_added" and e.world_size == newcomers + 2:
            booted = re.search(r"admitted after booting ([0-9.]+) s", e.detail)
            if booted:
                return e.time - float(booted.group(1))
    return None


def one_rep(cluster: Cluster, base_node: str, workdir: str, tag: str, env: dict[str, str]) -> list[dict]:
    """One run: 2 workers, then a fresh node offered and 2 newcomers; each newcomer's marks."""
    hosts_file = os.path.join(workdir, f"hosts-{tag}.json")
    progress, stop = os.path.join(workdir, f"progress-{tag}"), os.path.join(workdir, f"stop-{tag}")
    marks_dir = os.path.join(workdir, f"marks-{tag}")
    os.makedirs(marks_dir)
    Path(hosts_file).write_text(json.dumps({base_node: 2}))
    trainer = elastic.ElasticTrainer(
        train_fn,
        min_workers=2,
        max_workers=4,
        # recovery.py's loop (the small MLP, DistributedOptimizer, a commit every 10 steps), 10 ms a step
        config={
            "steps": 20_000,
            "step_time": 0.01,
            "progress": progress,
            "stop": stop,
            "hook": WriteMarksOnce(marks_dir),
        },
        discovery=FileDiscovery(hosts_file),
        discovery_interval=1,
        verbose=0,
    )
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()), daemon=True)
    runner.start()
    wait_progress(progress, "2 workers training", lambda p: p["step"] >= 50)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the node's raylet inherits them, and the newcomers' processes from it
    try:
        node = cluster.add_node(num_cpus=2)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    cluster.wait_for_nodes()
    Path(hosts_file).write_text(json.dumps({base_node: 2, node.node_id: 2}))
    offered = time.time()
    seen = wait_progress(progress, "the world to grow to 4", lambda p: p["world_size"] == 4)
    wait_progress(progress, "steady steps at 4", lambda p, s=seen["step"]: p["step"] >= s + 30)
    Path(stop).touch()
    runner.join(120)
    cluster.remove_node(node)
    result = box["result"]
    spawned = spawn_time(result.events, 2)
    rows = []
    for path in sorted(Path(marks_dir).glob("*.json")):
        record = json.loads(path.read_text())
        marks = record["marks"]
        if marks["actor_entered"] < offered:
            continue  # one of the first 2 workers
        marks["offered"] = offered
        if spawned is not None:
            marks["spawned"] = spawned
        rows.append(
            {
                "worker_id": record["worker_id"],
                "pid": record["pid"],
                "ray_elastic": record["ray_elastic"],
                "marks": marks,
                "process_started_after_offer_s": record["process_started"] - offered,
                "phases": {p.label: p.seconds for p in boot_marks.phases(marks)},
                "boot_s": marks["first_step"] - offered,
            }
        )
    return rows


def summarize(rows: list[dict]) -> dict:
    """Each phase's median seconds and its share of the median boot, in boot order; the largest phase."""
    labels = list(dict.fromkeys(label for r in rows for label in r["phases"]))
    boot = statistics.median(r["boot_s"] for r in rows)
    medians = {label: statistics.median(r["phases"][label] for r in rows if label in r["phases"]) for label in labels}
    largest = max(medians, key=lambda label: medians[label])
    return {
        "boot_median_s": boot,
        "phases": {label: {"median_s": s, "share": s / boot} for label, s in medians.items()},
        "largest": largest,
        "process_started_after_offer_median_s": statistics.median(r["process_started_after_offer_s"] for r in rows),
        "newcomers": len(rows),
    }


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`name` or `name=VAR=value[,VAR=value]`: a variant's name and the newcomers' environment."""
    name, _, spec = text.partition("=")
    env = dict(item.split("=", 1) for item in spec.split(",") if item)
    return name, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--variants", nargs="*", default=["default"], help="name[=VAR=value,...]: interleaved, side by side"
    )
    parser.add_argument("--out", default="boot_phases", help="results file name under bench/results")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **own_dashboard()})
    base = cluster.add_node(num_cpus=2).node_id
    ray.init(address=cluster.address, logging_level=logging.ERROR)
    cluster.wait_for_nodes()
    rows: dict[str, list[dict]] = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory() as workdir:
        for rep in range(args.reps):
            for name, env in variants:
                got = one_rep(cluster, base, workdir, f"{name}-{rep}", env)
                rows[name].extend(dict(r, variant=name, rep=rep) for r in got)
                boots = ", ".join(f"{r['boot_s']:.2f}" for r in got)
                print(f"{name} rep {rep}: {len(got)} newcomers, boot {boots} s", flush=True)
    ray.shutdown()
    cluster.shutdown()
    summaries = {name: summarize(r) for name, r in rows.items() if r}
    for name, summary in summaries.items():
        print(
            f"\n{name}: offer -> newcomer's first step, median {summary['boot_median_s']:.3f} s "
            f"over {summary['newcomers']} newcomers"
        )
        for label, p in summary["phases"].items():
            print(f"  {label:<50} {p['median_s']:7.3f} s  {100 * p['share']:5.1f}%")
        print(
            f"  largest: {summary['largest']}; process started "
            f"{summary['process_started_after_offer_median_s']:.3f} s after the offer"
        )
    flat = [r for variant_rows in rows.values() for r in variant_rows]
    write_results(args.out, flat, reps=args.reps, variants=dict(variants), summaries=summaries)


if __name__ == "__main__":
    main()
