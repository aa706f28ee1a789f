"""The control plane dying mid-run: the driver actor, the KV actor, and both at once, SIGKILLed.

On a local cluster (a head without CPUs, where the driver and KV actors run,
and two 2-CPU nodes), `ElasticTrainer(4, 4)` trains `counting_train_fn`
(tests/support/workloads.py; a 10 ms step, a commit every 5 steps). Rank 0 SIGKILLs
the target's process right after step 50 (the time is written by the
killing process). Per repetition:

- steps lost: steps missing from rank 0's reports plus steps reported twice
  (redone after a rollback); target 0;
- pause: rank 0's longest gap between two consecutive steps from the kill
  on, beside its median step; target <= 1 s;
- back: the kill to the `driver_restarted` / `kv_restarted` event (the new
  instance has loaded its snapshot / been told the generation);
- resets.

Also the driver's snapshot mid-run: its size, and the time to pickle it and
put it in the GCS's key-value store (what the driver does after every
batch), over 200 repetitions.

Prints a table and writes bench/results/control_plane.json. Reports, never asserts.

    .venv/bin/python bench/control_plane.py [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from own_dashboard import local_cluster
from ray.experimental import internal_kv
from results_file import write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from workloads import counting_train_fn  # noqa: E402

import ray_elastic as elastic  # noqa: E402

KILL_AT = 50
STEPS = 300
EVENT = {"kill_driver": "driver_restarted", "kill_kv": "kv_restarted", "kill_both": "driver_restarted"}


def snapshot_cost(stop: threading.Event, out: dict) -> None:
    """Once the run is under way, time what the driver does after each batch: pickle its state, put it."""
    while not stop.is_set():
        keys = internal_kv._internal_kv_list(b"driver/", namespace="ray_elastic")
        if keys:
            blob = internal_kv._internal_kv_get(keys[0], namespace="ray_elastic")
            if blob is not None and len(blob) > 0:
                state = pickle.loads(blob)
                took = []
                for _ in range(200):
                    began = time.perf_counter()
                    again = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
                    internal_kv._internal_kv_put(b"bench/scratch", again, overwrite=True, namespace="ray_elastic")
                    took.append(time.perf_counter() - began)
                internal_kv._internal_kv_del(b"bench/scratch", namespace="ray_elastic")
                out.update(bytes=len(blob), median_s=statistics.median(took), max_s=max(took))
                return
        time.sleep(0.1)


def one(action: str, workdir: Path, rep: int) -> dict:
    marker = workdir / f"{action}-{rep}"
    faults = [{"rank": 0, "step": KILL_AT, "action": action, "marker": str(marker)}]
    config = {"faults": faults, "steps": STEPS, "step_time": 0.01, "deadline_s": 300}
    result = elastic.ElasticTrainer(counting_train_fn, 4, 4, config=config, verbose=0).fit()
    killed = json.loads(marker.read_text())["time"]
    steps = [m["step"] for m in result.metrics_history]
    times = result.metric_times
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    after = [b - a for a, b in zip(times, times[1:], strict=False) if b > killed]
    back = [e.time - killed for e in result.events if e.kind == EVENT[action] and e.time > killed]
    return {
        "action": action,
        "rep": rep,
        "steps_missing": len(set(range(1, STEPS + 1)) - set(steps)),
        "steps_twice": len(steps) - len(set(steps)),
        "pause_s": max(after),
        "median_step_s": statistics.median(gaps),
        "back_s": back[0] if back else None,
        "resets": result.resets,
        "events": [e.kind for e in result.events],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows, snap = [], {}
    with local_cluster():
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            stop = threading.Event()
            watcher = threading.Thread(target=snapshot_cost, args=(stop, snap), daemon=True)
            watcher.start()
            for rep in range(args.reps):
                for action in ("kill_driver", "kill_kv", "kill_both"):
                    row = one(action, workdir, rep)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            stop.set()
    header = ("killed", "lost", "twice", "pause p50", "max", "step", "back p50", "resets")
    print("\n{:>12} {:>5} {:>5} {:>9} {:>6} {:>6} {:>8} {:>6}".format(*header))
    for action in ("kill_driver", "kill_kv", "kill_both"):
        mine = [r for r in rows if r["action"] == action]
        backs = [r["back_s"] for r in mine if r["back_s"] is not None]
        print(
            f"{action:>12} {sum(r['steps_missing'] for r in mine):>5} {sum(r['steps_twice'] for r in mine):>5} "
            f"{statistics.median(r['pause_s'] for r in mine):>8.3f}s {max(r['pause_s'] for r in mine):>5.3f}s "
            f"{statistics.median(r['median_step_s'] for r in mine):>5.3f}s "
            f"{(statistics.median(backs) if backs else float('nan')):>7.2f}s {sum(r['resets'] for r in mine):>6}"
        )
    if snap:
        print(
            f"\ndriver snapshot: {snap['bytes']} bytes; pickle + GCS put median {snap['median_s'] * 1e3:.2f} ms, "
            f"max {snap['max_s'] * 1e3:.2f} ms"
        )
    write_results("control_plane", rows, snapshot=snap, kill_at=KILL_AT, steps=STEPS, reps=args.reps)


if __name__ == "__main__":
    main()
