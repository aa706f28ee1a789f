"""False positives of the liveness check under full CPU load: no worker is harmed, so every failure is one.

On a local cluster (a head without CPUs and 2 nodes of 2 CPUs), 4 workers
train a small numpy model (an allreduce of `--payload` float32 per step, a
commit every 5 steps) with every option at its default (`liveness_timeout`
2 s), while `--hogs` processes (default: two per core) spin on every core at
the workers' own priority (`--nice`, 15 as Ray starts its workers), so the workers' threads, the pings' control
threads and the node probes all wait for CPU. Nothing is killed, hung or
withdrawn: every `worker_failed` or `newcomer_failed` event, and every
reset, is a false positive. The run lasts `--minutes`, then the ranks stop
together (a stop file, agreed by an allreduce).

Prints the figures and writes bench/results/false_positives.json. Reports,
never asserts.

    .venv/bin/python bench/false_positives.py [--minutes 30] [--hogs N] [--payload 100000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from own_dashboard import local_cluster
from results_file import write_results

import ray_elastic as elastic


def train_fn(config: dict) -> int:
    state = elastic.ObjectState(step=0, w=np.zeros(config["payload"], dtype=np.float32))
    stop = Path(config["stop"])

    @elastic.run
    def train(state: elastic.ObjectState) -> int:
        while elastic.allreduce(np.array([float(stop.exists())]), elastic.Max)[0] == 0.0:
            state.w = state.w + elastic.allreduce(np.ones_like(state.w), elastic.Average) * 1e-6
            state.step += 1
            elastic.report({"step": state.step, "world_size": elastic.size()})
            if state.step % 5 == 0:
                state.commit()
            else:
                state.check_host_updates()
        return state.step

    return train(state)


def spin(nice: int) -> None:
    """A CPU hog at the workers' priority (Ray starts its workers at nice 15): never sleeps, terminated by the bench.

    At nice 0 the hogs would take ~97% of every core from the whole Ray job (the driver actor too): that is a
    machine whose own processes outrank the job, where nothing of the job answers in time, not a loaded job.
    """
    os.nice(nice - os.nice(0))
    x = 0
    while True:
        x += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--hogs", type=int, default=2 * (os.cpu_count() or 2))
    parser.add_argument("--payload", type=int, default=100_000)
    parser.add_argument("--nice", type=int, default=15, help="the hogs' niceness (Ray's workers run at 15)")
    args = parser.parse_args()
    hogs = [multiprocessing.Process(target=spin, args=(args.nice,), daemon=True) for _ in range(args.hogs)]
    with local_cluster(nodes=2), tempfile.TemporaryDirectory() as workdir:
        stop = os.path.join(workdir, "stop")
        trainer = elastic.ElasticTrainer(
            train_fn, min_workers=4, max_workers=4, config={"stop": stop, "payload": args.payload}, verbose=0
        )
        box: dict = {}
        runner = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()), daemon=True)
        try:
            runner.start()
            for hog in hogs:
                hog.start()
            loaded_at = time.time()
            time.sleep(args.minutes * 60)  # a benchmark's fixed duration: what is measured is what happens in it
            Path(stop).touch()
            runner.join(600)
        finally:
            for hog in hogs:
                hog.terminate()
    result = box["result"]
    loaded = [t for t in result.metric_times if t >= loaded_at]
    failures = [e for e in result.events if e.kind in ("worker_failed", "newcomer_failed", "reset_requested")]
    figures = {
        "minutes_under_load": (max(loaded) - loaded_at) / 60 if loaded else 0.0,
        "hogs": args.hogs,
        "hogs_nice": args.nice,
        "cpus": os.cpu_count(),
        "steps_under_load": len(loaded),
        "steps_per_s_under_load": len(loaded) / (max(loaded) - loaded_at) if len(loaded) > 1 else 0.0,
        "false_positives": len(failures),
        "resets": result.resets,
        "events": [(e.kind, e.detail) for e in result.events],
        "liveness_timeout_s": 2.0,
    }
    print(figures)
    write_results("false_positives", [figures])


if __name__ == "__main__":
    main()
