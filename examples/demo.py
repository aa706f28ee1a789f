"""`make demo`: elastic training through a worker crash and a node joining.

Starts a local Ray cluster of three nodes (a head without CPUs and two nodes
of 2 CPUs: 4 worker slots), trains the digits example (scikit-learn's bundled
handwritten digits, PyTorch) on 4 workers, SIGKILLs one worker during
training, then adds a third worker node. Prints the test accuracy, the
world-size timeline, each membership event with its recovery time, and the
time from the SIGKILL to the survivors' next completed step, and saves a
timeline plot to demo_output/timeline.png.

`make demo-docs` runs it, then `demo.py --readme PRINTED` puts what it
printed into README.md (between its demo-output markers) and its plot into
docs/demo_timeline.png: the README's output and picture are one run's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from digits import train_fn  # noqa: E402

import ray_elastic as elastic  # noqa: E402

KILL_STEP = 40
ADD_NODE_STEP = 80
EPOCHS = 25


class DemoHook:
    """Runs after every step in every worker: simulated compute, the crash, a progress mark."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir

    def __call__(self, step: int) -> None:
        time.sleep(0.02)  # stands for the forward/backward pass of a bigger model
        if step == KILL_STEP and elastic.rank() == 2:
            marker = os.path.join(self.workdir, "killed")
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return  # the crash happens once, not again after the rollback
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)
        if step == ADD_NODE_STEP and elastic.rank() == 0:
            Path(self.workdir, "add-node").touch()


def timeline(result: elastic.Result) -> list[str]:
    t0, history = result.metric_times[0], result.metrics_history
    lines, start = [], 0
    for i in range(1, len(history) + 1):
        if i == len(history) or history[i]["world_size"] != history[start]["world_size"]:
            m0, m1 = history[start], history[i - 1]
            lines.append(
                f"  {result.metric_times[start] - t0:6.1f} s - {result.metric_times[i - 1] - t0:6.1f} s  "
                f"world size {m0['world_size']}  steps {m0['step']}-{m1['step']}"
            )
            start = i
    return lines


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    workdir = tempfile.mkdtemp(prefix="ray-elastic-demo-")
    print("starting a local Ray cluster: head + 2 nodes x 2 CPUs ...", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    cluster.wait_for_nodes()

    trainer = elastic.ElasticTrainer(
        train_fn,
        min_workers=2,
        max_workers=6,
        config={"epochs": EPOCHS, "commit_every": 5, "step_hook": DemoHook(workdir)},
        cooldown_range=(3, 30),
    )
    outcome: dict = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            outcome["error"] = e

    # fit() runs beside the main thread, which alone may change the cluster (Ray's rule)
    runner = threading.Thread(target=fit, daemon=True)
    runner.start()
    flag = Path(workdir, "add-node")
    deadline = time.monotonic() + 300
    while runner.is_alive() and not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if flag.exists():
        print("\n>>> adding a third worker node (2 CPUs)", flush=True)
        cluster.add_node(num_cpus=2)
    runner.join(600)
    ray.shutdown()
    cluster.shutdown()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]

    killed_at = json.loads(Path(workdir, "killed").read_text())["time"]
    next_step = next(t for t, m in zip(result.metric_times, result.metrics_history, strict=True) if t > killed_at)
    print("\nworld-size timeline (rank 0's steps):")
    print("\n".join(timeline(result)))
    print("\nmembership events:")
    for ev in result.events:
        took = f"{ev.reset_duration:.3f} s" if ev.reset_duration is not None else "-"
        print(
            f"  {ev.kind:15s} generation {ev.generation:2d}  world size {ev.world_size}  reset {took:>8s}  {ev.detail}"
        )
    print(f"\nSIGKILL -> survivors' next completed step: {next_step - killed_at:.3f} s")
    value = result.return_value
    equal = all(c["equal"] for c in value["sync_checks"]) and len(set(value["final_digests"])) == 1
    print(f"ranks held bitwise-equal state after every sync: {equal}")
    print(
        f"test accuracy {value['accuracy']:.3f} after {EPOCHS} epochs, "
        f"{value['steps']} steps; final loss {result.metrics['loss']:.3f}"
    )
    png = result.plot_timeline(Path("demo_output") / "timeline.png")
    print(f"timeline plot (world size and steps/s, events marked): {os.path.relpath(png)}")
    failed = [e for e in result.events if e.kind == "worker_failed"]
    added = [e for e in result.events if e.kind == "hosts_added"]
    if not failed or not added:
        print("the demo expected at least one recovery and one scale-up", file=sys.stderr)
        return 1
    return 0


BEGIN, END = "<!-- demo output: make demo-docs -->\n```\n", "```\n<!-- end of demo output -->"


def update_readme(
    printed: Path, readme: Path = ROOT / "README.md", picture: Path = ROOT / "docs" / "demo_timeline.png"
) -> None:
    """Put the demo's printed lines into the README's block and its plot into docs/demo_timeline.png."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no demo-output markers ({BEGIN.splitlines()[0]!r})")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    readme.write_text(head + BEGIN + printed.read_text().rstrip("\n") + "\n" + END + tail)
    shutil.copyfile(Path("demo_output") / "timeline.png", picture)
    print(f"{readme} and {picture} now hold this run's output")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--readme"]:
        update_readme(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
