"""A loop for the hot-spare cluster test: each process says when it booted, each step who trained in which world.

Every worker imports torch (a real boot's cost), writes `booted/<pid>` (the
wall time) once its `train_fn` has built its state, just before the run
loop (where a spare waits), and one JSON line per step to
`steps-<pid>.jsonl`: its generation, rank, world size, step and the time.
The ranks train until the test writes `stop` (agreed by an allreduce, so
they all return at the same step).
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
            time.sleep(0.05)
        return state.step

    return {"steps": train(state)}
