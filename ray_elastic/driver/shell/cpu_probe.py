"""Whether a worker that misses pings is computing or stuck: its threads' CPU time, read on its node.

A worker answers the driver's ping from its control threads, which need the
GIL. A long C call that keeps the GIL (an extension op that does not release
it) silences the worker though nothing is wrong, exactly as a deadlock does.
Before the driver kills a member that missed a ping, its shell asks the
`ProcessProbe` on the member's node (one small actor per node, num_cpus=0,
started the first time a worker there misses a ping, kept until the run
ends) to read `/proc/<pid>/task/*/stat` twice, `window` seconds apart: a
thread whose CPU time advances is computing. The core's policy
(`policies.judge_missed_ping`) decides what that means.

Linux only: elsewhere the reading fails, and a silent member is killed as
before.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.driver.core.messages import CpuSample


def _threads(pid: int) -> dict[str, tuple[str, int]]:
    """`{thread id: (state letter, utime + stime in clock ticks)}` of process `pid`."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
        out[tid] = (fields[0], int(fields[11]) + int(fields[12]))
    return out


def _state(pid: int, first: dict[str, tuple[str, int]], second: dict[str, tuple[str, int]]) -> str:
    """The process's state for the judge: R (D) if a thread was runnable (in a disk wait) at both readings, else
    the main thread's letter at the second.

    `/proc/<pid>/stat` gives the main thread's letter only. A process starved
    of CPU on a loaded node often shows its main thread sleeping on a lock or
    a queue that a runnable thread of its own (Ray's, torch's) is yet to be
    given a CPU to serve: waiting for the machine, not hung. Such a thread
    stays runnable across the window. A hung process's threads are runnable
    only for an instant (Ray's I/O threads serving the very ping it misses,
    a Python thread waking to ask for the GIL), and one caught so at a
    single reading would spare a hung worker for another round.
    """
    for wanting in ("R", "D"):
        if any(letter == wanting and first.get(tid, ("",))[0] == wanting for tid, (letter, _) in second.items()):
            return wanting
    if str(pid) in second:  # the main thread's id is the process's: its letter was read with the others
        return second[str(pid)][0]
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2]


def sample_cpu(pids: list[int], window: float) -> dict[int, CpuSample | str]:
    """Each process's busiest thread's CPU time over `window` seconds, or why it could not be read."""
    if not os.path.isdir("/proc/self/task"):
        return {pid: "this node has no /proc to read CPU times from (not Linux)" for pid in pids}
    before: dict[int, dict[str, tuple[str, int]] | str] = {}
    for pid in pids:
        try:
            before[pid] = _threads(pid)
        except FileNotFoundError:
            before[pid] = f"process {pid} is gone"
        except OSError as e:
            before[pid] = f"cannot read /proc/{pid}: {e}"
    started = time.monotonic()
    time.sleep(window)
    elapsed = time.monotonic() - started
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, CpuSample | str] = {}
    for pid, first in before.items():
        if isinstance(first, str):
            out[pid] = first
            continue
        try:
            second = _threads(pid)
            state = _state(pid, first, second)
        except FileNotFoundError:
            out[pid] = f"process {pid} ended during the reading"
            continue
        used = [(cpu - first[tid][1]) / ticks for tid, (_, cpu) in second.items() if tid in first]
        out[pid] = CpuSample(busiest_thread_s=max(used, default=0.0), window_s=elapsed, state=state)
    return out


class ProcessProbe:
    """Reads processes' CPU time on its node (`sample_cpu`); the driver starts one per node, pinned there."""

    def sample(self, pids: list[int], window: float) -> dict[int, CpuSample | str]:
        return sample_cpu(pids, window)

    def ping(self) -> None:
        """Answered with every liveness round: a node whose probe is silent too is unreachable, not busy."""


def start_probe(node_id: str) -> Any:
    """A `ProcessProbe` pinned to `node_id` (num_cpus=0: it takes no worker's slot)."""
    cls = ray.remote(num_cpus=0, max_restarts=0)(ProcessProbe)
    return cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
