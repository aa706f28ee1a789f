"""Where the machine's CPU went during a benchmark window, per process and per thread.

Reads every thread's user + system time from /proc before and after a window
and sorts the difference into classes: the ranks of the system being timed
(split by thread name, so a rank's compute thread shows apart from Ray's and
Gloo's threads in the same process), the idle systems' ranks, Ray's own
processes (raylet, GCS, dashboard, idle workers), ray-elastic's driver and KV
actors, the benchmark process itself, and everything else on the machine
(other users' jobs on a shared machine). Linux only.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

# Ray's processes, by a word of their command line
_RAY_SYSTEM = ("gcs_server", "raylet", "dashboard", "log_monitor", "monitor.py", "runtime_env", "agent")


def _threads(pid: int) -> dict[int, tuple[str, float, float, int]]:
    """tid -> (thread name, CPU seconds, of which in the kernel, minor page faults) so far; empty if gone."""
    out: dict[int, tuple[str, float, float, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the name: fields[7] minflt, [11] utime, [12] stime (proc(5), counted from 0 here)
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) * _TICK_S, int(fields[12]) * _TICK_S, int(fields[7]))
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Snapshot:
    """Every thread's CPU time on the machine at one moment."""

    def __init__(self) -> None:
        self.at = time.perf_counter()
        self.threads: dict[int, dict[int, tuple[str, float, float, int]]] = {}
        self.cmdlines: dict[int, str] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                pid = int(entry)
                self.threads[pid] = _threads(pid)
                self.cmdlines[pid] = _cmdline(pid)


def account(before: Snapshot, after: Snapshot, active: set[int], idle: set[int]) -> dict:
    """CPU seconds per class between two snapshots; `active`/`idle`: rank pids of the timed and the idle systems.

    Returns {"wall_s", "classes": {class: s}, "active_threads": {thread name: s}}. A thread born
    during the window counts from zero.
    """
    me = os.getpid()
    classes: dict[str, float] = defaultdict(float)
    active_threads: dict[str, float] = defaultdict(float)
    active_kernel_s, active_faults = 0.0, 0
    for pid, threads in after.threads.items():
        old = before.threads.get(pid, {})
        used = {}
        for tid, (name, cpu, kernel, faults) in threads.items():
            _, cpu0, kernel0, faults0 = old.get(tid, (name, 0.0, 0.0, 0))
            used[tid] = (name, cpu - cpu0, kernel - kernel0, faults - faults0)
        total = sum(u[1] for u in used.values())
        if total <= 0:
            continue
        cmd = after.cmdlines.get(pid, "")
        if pid in active:
            cls = "ranks (timed system)"
            for tid, (name, cpu, kernel, faults) in used.items():
                active_threads[f"{name} (main thread)" if tid == pid else name] += cpu
                active_kernel_s += kernel
                active_faults += faults
        elif pid in idle:
            cls = "ranks (idle systems)"
        elif pid == me:
            cls = "benchmark process"
        elif cmd.startswith(("ray::DriverHost", "ray::DriverActor", "ray::KVStore")):
            cls = "ray-elastic driver + KV actors"
        elif cmd.startswith("ray::") or any(word in cmd for word in _RAY_SYSTEM):
            cls = "Ray's processes"
        else:
            cls = "other (not this benchmark)"
        classes[cls] += total
    return {
        "wall_s": after.at - before.at,
        "classes": dict(classes),
        "active_threads": dict(sorted(active_threads.items(), key=lambda kv: -kv[1])),
        "active_kernel_s": active_kernel_s,  # the timed ranks' CPU spent in the kernel (page faults, syscalls)
        "active_minor_faults": active_faults,
    }
