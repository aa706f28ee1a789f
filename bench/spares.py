"""Back to full strength after a SIGKILL: with a hot spare, without one, and Ray Train v2, side by side in one run.

On a local cluster (a head without CPUs and 3 nodes of 2 CPUs: 6 slots), 4
workers train `bench/recovery.py`'s small MLP (`TorchState` +
`DistributedOptimizer`, a commit every 10 steps). In each repetition one
worker (seeded: random rank but 0, random step) SIGKILLs itself right after
its step. Measured from the kill, from rank 0's reports:

- `next_step_s`: the survivors' first completed step (at any world size);
- `full_s`: the first step at world size 4 again (the issue's figure).

`spares=1` keeps a booted spare on the third node: the world is back at 4
in the generation right after the death. `spares=0` trains at 3 until a
replacement has booted (placement, process, `import torch`, `train_fn`'s
set-up) on a free slot. The arms alternate within each repetition (same
kill), so the machine's load falls on both alike. Ray Train v2
(`TorchTrainer`, 4 workers, `FailureConfig(max_failures=3)`, a checkpoint
every `--rt-every` steps) restarts every worker: its first step after the
kill is also its first at full strength.

Prints medians and writes bench/results/spares.json. Reports, never asserts.

    .venv/bin/python bench/spares.py [--reps 5] [--rt-reps 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
from pathlib import Path

from own_dashboard import local_cluster
from recovery import KillOnce, raytrain_rep, train_fn
from results_file import write_results
from scale import wait_progress

import ray_elastic as elastic


def elastic_rep(spares: int, kill_rank: int, kill_step: int, workdir: str, tag: str) -> dict:
    """One run of 4 workers with `spares`; one member SIGKILLs itself; trained until back at 4 for 50 steps."""
    marker, progress, stop = (os.path.join(workdir, f"{name}-{tag}") for name in ("killed", "progress", "stop"))
    trainer = elastic.ElasticTrainer(
        train_fn,
        min_workers=2,
        max_workers=4,
        spares=spares,
        config={"steps": 10**6, "hook": KillOnce(kill_rank, kill_step, marker), "progress": progress, "stop": stop},
        cooldown_range=(60, 60),
        verbose=0,
    )
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()), daemon=True)
    runner.start()
    wait_progress(progress, "the kill", lambda p: os.path.exists(marker), timeout=300)
    killed = json.loads(Path(marker).read_text())
    wait_progress(progress, "world 4 again", lambda p: p["world_size"] == 4 and p["step"] >= kill_step + 50, 300)
    Path(stop).touch()
    runner.join(120)
    result = box["result"]
    reports = list(zip(result.metric_times, result.metrics_history, strict=True))
    # the survivors' first step in the next generation: the first report after the kill that went back (the
    # rollback to the last commit: the kill is never at a commit step) or changed the world size; rank 0 may still
    # report the killed step itself just after the kill
    t_next, m_next = next(
        (t, m)
        for (_, prev), (t, m) in zip(reports, reports[1:], strict=False)
        if t > killed["time"] and (m["step"] <= prev["step"] or m["world_size"] != prev["world_size"])
    )
    after = [(t, m) for t, m in reports if t >= t_next]
    t_full = next(t for t, m in after if m["world_size"] == 4)
    return {
        "spares": spares,
        "kill_rank": kill_rank,
        "kill_step": kill_step,
        "next_step_s": t_next - killed["time"],
        "full_s": t_full - killed["time"],
        "world_after_kill": m_next["world_size"],
        "spares_promoted": result.spares_promoted,
        "events": [(e.kind, e.world_size, e.reset_duration) for e in result.events],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rt-reps", type=int, default=2, help="Ray Train v2 repetitions (0 to skip)")
    parser.add_argument("--rt-every", type=int, default=50, help="Ray Train: steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows: list[dict] = []
    rt_rows: list[dict] = []
    with local_cluster(nodes=3), tempfile.TemporaryDirectory() as workdir:
        for rep in range(args.reps):
            kill_rank, kill_step = rng.randint(1, 3), rng.randint(6, 14) * 10 + rng.randint(1, 9)  # not a commit
            order = (1, 0) if rep % 2 == 0 else (0, 1)
            for spares in order:
                row = elastic_rep(spares, kill_rank, kill_step, workdir, f"{rep}-{spares}")
                rows.append(row)
                print(
                    f"rep {rep} spares={spares}: next step {row['next_step_s']:.2f} s at world "
                    f"{row['world_after_kill']}, full strength {row['full_s']:.2f} s",
                    flush=True,
                )
        for rep in range(args.rt_reps):
            row = raytrain_rep(rng, workdir, rep, args.rt_every)
            rt_rows.append({**row, "full_s": row["recovery_s"]})
            print(f"Ray Train v2 rep {rep}: first step (all 4 restarted) {row['recovery_s']:.2f} s", flush=True)
    summary: dict = {}
    for spares in (1, 0):
        mine = [r for r in rows if r["spares"] == spares]
        summary[f"spares={spares}"] = {
            "full_s_median": statistics.median(r["full_s"] for r in mine),
            "full_s_max": max(r["full_s"] for r in mine),
            "next_step_s_median": statistics.median(r["next_step_s"] for r in mine),
            "reps": len(mine),
        }
    if rt_rows:
        summary["ray_train_v2"] = {
            "full_s_median": statistics.median(r["full_s"] for r in rt_rows),
            "reps": len(rt_rows),
        }
    print(json.dumps(summary, indent=2))
    write_results("spares", rows + [{"ray_train_v2": r} for r in rt_rows], summary=summary)


if __name__ == "__main__":
    main()
