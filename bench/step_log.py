"""Recovery of a framework-driven loop: rank 0's step log, the injected SIGKILL, and reading the two.

Lightning and transformers.Trainer own their loops, so a step-end callback
does what `bench/recovery.py`'s loop does inline: rank 0 appends one line
per completed optimizer step (`time`, `step`, world size, its pid), and the
chosen rank SIGKILLs itself after the chosen step, once (a marker file,
written just before the kill, records when). The same callback runs in
ray-elastic and in Ray Train, so both are read the same way: recovery is
from the kill to rank 0's first completed step of the group that goes on
after it (a new world size or a new rank-0 process: ray-elastic's survivors
on the smaller ring, or Ray Train's restarted group), and steps redone are
the completed steps that group trains again.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path


def log_step(path: str, step: int, world: int) -> None:
    """Rank 0: one line for a completed step."""
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), "step": step, "world": world, "pid": os.getpid()}) + "\n")


def kill_once(marker: str, step: int) -> None:
    """SIGKILL this process now, unless the marker says a kill already happened in this run."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"time": time.time(), "step": step}))
    os.kill(os.getpid(), signal.SIGKILL)


def read_recovery(log: str, marker: str) -> dict:
    """Recovery time, steps redone and the world after, from rank 0's log and the kill's marker."""
    killed = json.loads(Path(marker).read_text())
    entries = [json.loads(line) for line in Path(log).read_text().splitlines()]
    before = [e for e in entries if e["time"] <= killed["time"]]
    who = (before[-1]["pid"], before[-1]["world"])
    first = next(e for e in entries if e["time"] > killed["time"] and (e["pid"], e["world"]) != who)
    return {
        "kill_step": killed["step"],
        "recovery_s": first["time"] - killed["time"],
        "steps_redone": killed["step"] - (first["step"] - 1),
        "world_after": first["world"],
        "rank0_restarted": first["pid"] != who[0],
    }


def summarize(rows: list[dict]) -> dict:
    rec = sorted(r["recovery_s"] for r in rows)
    return {
        "p50_s": statistics.median(rec),
        "max_s": rec[-1],
        "min_s": rec[0],
        "median_steps_redone": statistics.median(r["steps_redone"] for r in rows),
        "reps": len(rows),
    }
