"""A loop for the hot-spare cluster test: each process says when it booted, each step who trained in which world.

Every worker imports torch (a real boot's cost), writes `booted/<pid>` (the
wall time) once its `train_fn` has built its state, just before the run
loop (where a spare waits), and one JSON line per step to
`steps-<pid>.jsonl`: its generation, rank, world size, step and the time.
The ranks train until the test writes `stop` (agreed by an allreduce, so
they all return at the same step). Rank 0 reports each step (`elastic.report`),
as a Tune trial's loop must.

The test's side reads those records: `booted`, `steps`, `new_boot`, `gone`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

import ray_elastic as elastic
from ray_elastic.runtime.process import current


def spare_train_fn(config: dict) -> dict:
    import torch  # noqa: F401 - what a real worker's boot imports

    out = Path(config["dir"])
    state = elastic.ObjectState(step=0, w=np.zeros(8))
    (out / "booted").mkdir(exist_ok=True)
    (out / "booted" / str(os.getpid())).write_text(str(time.time()))
    stop, ledger = out / "stop", out / f"steps-{os.getpid()}.jsonl"

    @elastic.run
    def train(state: elastic.ObjectState) -> int:
        x = np.random.default_rng(0).normal(size=(32, 8))
        while elastic.allreduce(np.array([float(stop.exists())]), elastic.Max)[0] == 0.0:
            state.w = state.w - 0.01 * elastic.allreduce(x.T @ (x @ state.w - 1.0) / len(x), elastic.Average)
            state.step += 1
            line = {"generation": current().generation, "rank": elastic.rank(), "size": elastic.size()}
            with ledger.open("a") as f:
                f.write(json.dumps({**line, "step": state.step, "time": time.time()}) + "\n")
            state.commit()
            elastic.report({"step": state.step, "world": elastic.size()})
            time.sleep(0.05)
        return state.step

    return {"steps": train(state)}


def booted(out: Path) -> dict[int, float]:
    """Every worker process that reached its run loop, and when."""
    folder = out / "booted"
    return {int(p.name): float(p.read_text() or 0) for p in folder.iterdir()} if folder.exists() else {}


def steps(out: Path) -> list[dict]:
    """Every step every worker trained, with its pid (whole lines only)."""
    lines = []
    for path in out.glob("steps-*.jsonl"):
        text = path.read_text()
        pid = int(path.stem.split("-")[1])
        lines += [{**json.loads(line), "pid": pid} for line in text[: text.rfind("\n") + 1].splitlines()]
    return lines


def gone(pid: int) -> bool:
    """The process exited (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def new_boot(out: Path, known: set[int], what: str) -> int:
    """Wait for a worker process not in `known` to reach its run loop; its pid."""
    from conftest import wait_until

    fresh = wait_until(lambda: set(booted(out)) - known, 90, what)
    assert len(fresh) == 1, f"{what}: {sorted(fresh)} booted at once"
    return fresh.pop()
