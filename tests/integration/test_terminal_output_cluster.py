"""What a user's terminal shows when a worker dies: our one event line, their own prints, nothing of Ray's dump.

A script runs `fit()` in a process of its own against the session's local
cluster (as a user's script would), and one of its two workers SIGKILLs
itself. Its captured stdout and stderr are what the user would have read.
Before, each death printed Ray's raw raylet dump (the OOM killer,
`ray stop --force`, SIGSEGV) and a "(DriverHost pid=...)" copy of the
event line; the detail now stays in the Ray session's log files.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ray_elastic.session_log import session_log_dir
from ray_elastic.trainer.ray_output import WORKER_DEATH_DUMP

SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from workloads import counting_train_fn
import ray_elastic as elastic

def train_fn(config):
    print("hello from train_fn", flush=True)  # the user's own output: Ray forwards it, and so it must stay
    return counting_train_fn(config)

faults = [{{"rank": 1, "step": 5, "action": "sigkill", "marker": {marker!r}}}]
result = elastic.ElasticTrainer(
    train_fn, min_workers=1, max_workers=2, config={{"steps": 40, "faults": faults}}, cooldown_range=(60, 60)
).fit()
print("run", result.run_id, "events", [e.kind for e in result.events])
"""


def test_a_killed_worker_shows_one_event_line_and_the_users_prints_but_no_ray_dump(cluster, no_leaks, tmp_path):
    marker = tmp_path / "killed"
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parents[1] / "support"), marker=str(marker)))
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    seen = done.stdout + done.stderr
    assert done.returncode == 0, seen[-4000:]
    assert marker.exists(), "the worker never killed itself: nothing was tested"
    assert "worker_failed" in done.stdout, seen[-4000:]

    died = [line for line in seen.splitlines() if " died" in line]
    assert len(died) == 1 and died[0].startswith("[ray-elastic] worker "), seen  # our line, once
    assert "(DriverHost pid=" not in seen and "(DriverActor pid=" not in seen, seen
    assert WORKER_DEATH_DUMP not in seen and "(raylet)" not in seen and "OOM" not in seen, seen
    assert "hello from train_fn" in seen, seen  # what train_fn prints still reaches the user

    # the detail went to the driver's log file in the Ray session's log directory
    run_id = done.stdout.split("run ", 1)[1].split()[0]
    logs = list(Path(session_log_dir()).glob(f"driver-{run_id}-*.log"))
    assert logs and " died: " in "".join(p.read_text() for p in logs), logs
    assert time.monotonic() - started < 60
