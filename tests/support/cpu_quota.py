"""A slow node on this machine: a Ray node's processes under a cgroup v1 CPU quota (CFS bandwidth control).

What it models: a node that turned slow at everything it computes, while
its network and disks are as before: a noisy neighbour taking the CPU, a
throttled (thermal, power-capped) processor, a cloud VM out of CPU credits.
Every process of the node (its raylet and, under it, the node's worker
processes and agents, including those the raylet starts later, which
inherit the cgroup) gets at most `cpus` CPUs in each 100 ms period: the
kernel runs them until they used their share of the period, then holds
them until the next one. That is a slowdown the node cannot see, not a
sleep in `train_fn`.

    with CpuQuota() as slow:
        slow.add_tree(raylet_pid)       # the node's processes, by the PIDs the test started
        slow.set(0.15)                  # at most 15% of one CPU from now on
        ...
        slow.set(None)                  # lifted: the node runs at full speed again
    # left: every process is back in its own cgroup, and the cgroup is removed

Needs root and cgroup v1's cpu controller at /sys/fs/cgroup/cpu
(`unavailable_reason()` says why not). The cgroup is named with a random
prefix; `close()` moves every process still in it back to the cgroup the
first one came from and removes it, is idempotent and runs at exit too.
"""

from __future__ import annotations

import atexit
import os
import secrets
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def unavailable_reason() -> str | None:
    """Why a CPU quota cannot be set here (no cgroup v1 cpu controller, not root), or None."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists() and not (CPU_ROOT / "cgroup.procs").exists():
        return f"no cgroup v1 cpu controller mounted at {CPU_ROOT}"
    if os.geteuid() != 0:
        return "creating a cgroup needs root"
    return None


def _cpu_cgroup_of(pid: int) -> str:
    """The cpu controller's cgroup of `pid`, from /proc (e.g. "/" or "/user.slice")."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return path
    return "/"


def tree(pid: int) -> list[int]:
    """`pid` and every process under it, now."""
    root = psutil.Process(pid)
    return [root.pid, *(c.pid for c in root.children(recursive=True))]


def cluster_node_pids(node: object) -> list[int]:
    """The processes of a `ray.cluster_utils.Cluster` node, as its `all_processes` records them."""
    return [info.process.pid for infos in node.all_processes.values() for info in infos]


class CpuQuota:
    """One cgroup of the cpu controller, holding a node's processes under a quota that can change.

    Args:
        cpus: the quota in CPUs (0.15: 15% of one CPU per period), or None
            for none yet.
    """

    def __init__(self, cpus: float | None = None) -> None:
        why = unavailable_reason()
        if why is not None:
            raise RuntimeError(f"cannot put a node under a CPU quota: {why}")
        self.path = CPU_ROOT / f"re{secrets.token_hex(3)}-slow-node"
        self.path.mkdir()
        self._home: str | None = None  # where the processes go back to
        self._closed = False
        atexit.register(self.close)
        (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        self.set(cpus)

    def add(self, pids: Iterable[int]) -> None:
        """Move these processes (every thread of each) into the cgroup; one gone already is skipped."""
        for pid in pids:
            try:
                if self._home is None:
                    self._home = _cpu_cgroup_of(pid)
                (self.path / "cgroup.procs").write_text(str(pid))
            except (FileNotFoundError, ProcessLookupError):
                continue  # it exited meanwhile

    def add_tree(self, pid: int) -> None:
        """`pid` and every process under it (a raylet: the node's workers and agents)."""
        self.add(tree(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]

    def set(self, cpus: float | None) -> None:
        """At most `cpus` CPUs per period from now on; None lifts the quota."""
        quota = -1 if cpus is None else max(1000, int(cpus * PERIOD_US))
        (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def throttled_s(self) -> float:
        """How long the kernel held the cgroup's processes back so far (cpu.stat's throttled_time)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["throttled_time"]) / 1e9

    def close(self) -> None:
        """Lift the quota, move every process back where the first came from, remove the cgroup."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if not self.path.exists():
            return
        (self.path / "cpu.cfs_quota_us").write_text("-1")
        home = CPU_ROOT / (self._home or "/").lstrip("/")
        deadline = time.monotonic() + 10
        while True:
            for pid in self.pids():
                try:
                    (home / "cgroup.procs").write_text(str(pid))
                except (FileNotFoundError, ProcessLookupError):
                    pass  # it exited meanwhile
            try:
                self.path.rmdir()
                return
            except OSError:  # a process forked into it meanwhile: move it too
                if time.monotonic() > deadline:
                    raise

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cpu_share(pids: Iterable[int], window_s: float = 2.0) -> float:
    """The CPUs these processes (and those under them) used together over `window_s`, e.g. 0.5: half a CPU."""
    pids = list(pids)

    def used() -> float:
        total = 0.0
        for root in pids:
            try:
                for pid in tree(root):
                    t = psutil.Process(pid).cpu_times()
                    total += t.user + t.system
            except psutil.NoSuchProcess:
                continue
        return total

    before, start = used(), time.monotonic()
    time.sleep(window_s)  # a measurement window, not a wait for a condition
    return (used() - before) / (time.monotonic() - start)
