"""The slow-node helper itself: a process tree under a CPU quota runs at most at that share, and nothing is left behind.

No Ray: a busy process and its busy child stand in for a raylet and its worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from cpu_quota import CpuQuota, cpu_share, tree, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

BUSY = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'while True: pass']); exec('while True: pass')"


def test_a_process_tree_runs_at_its_quota_until_it_is_lifted():
    parent = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        quota = CpuQuota()
        try:
            from conftest import wait_until

            wait_until(lambda: len(tree(parent.pid)) == 2, 10, "the busy child to start")
            quota.add_tree(parent.pid)
            quota.set(0.3)
            assert sorted(quota.pids()) == sorted(tree(parent.pid))
            throttled = quota.throttled_s()
            assert cpu_share([parent.pid], 1.5) < 0.3 * 1.15  # both processes together, however idle the machine
            assert quota.throttled_s() > throttled  # the kernel held them back
            quota.set(None)
            throttled = quota.throttled_s()
            cpu_share([parent.pid], 1.0)  # a second of running without a quota
            assert quota.throttled_s() == throttled  # lifted: never held back again (the machine's load aside)
        finally:
            quota.close()
        assert not quota.path.exists()
        assert all(f"/{quota.path.name}" not in open(f"/proc/{pid}/cgroup").read() for pid in tree(parent.pid))
    finally:
        for pid in reversed(tree(parent.pid)):
            os.kill(pid, signal.SIGKILL)
        parent.wait(10)
