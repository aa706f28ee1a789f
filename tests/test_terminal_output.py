"""What a user's terminal shows when a worker dies: our one event line, their own prints, nothing of Ray's dump.

A script runs `fit()` in a process of its own against the session's local
cluster (as a user's script would), and one of its two workers SIGKILLs
itself. Its captured stdout and stderr are what the user would have read.
Before, each death printed Ray's raw raylet dump (the OOM killer,
`ray stop --force`, SIGSEGV) and a "(DriverActor pid=...)" copy of the
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
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), marker=str(marker)))
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    seen = done.stdout + done.stderr
    assert done.returncode == 0, seen[-4000:]
    assert marker.exists(), "the worker never killed itself: nothing was tested"
    assert "worker_failed" in done.stdout, seen[-4000:]

    died = [line for line in seen.splitlines() if " died" in line]
    assert len(died) == 1 and died[0].startswith("[ray-elastic] worker "), seen  # our line, once
    assert "(DriverActor pid=" not in seen, seen
    assert WORKER_DEATH_DUMP not in seen and "(raylet)" not in seen and "OOM" not in seen, seen
    assert "hello from train_fn" in seen, seen  # what train_fn prints still reaches the user

    # the detail went to the driver's log file in the Ray session's log directory
    run_id = done.stdout.split("run ", 1)[1].split()[0]
    logs = list(Path(session_log_dir()).glob(f"driver-{run_id}-*.log"))
    assert logs and " died: " in "".join(p.read_text() for p in logs), logs
    assert time.monotonic() - started < 60


def test_the_dump_is_hidden_only_while_fit_runs_and_a_users_own_skip_pattern_stays(monkeypatch):
    """Ray's printing path in fit()'s process, fed as its error listener feeds it: what would reach the terminal."""
    import re

    from ray._private import ray_logging

    from ray_elastic.trainer.ray_output import worker_death_dumps_hidden

    dedup = ray_logging.stdout_deduplicator
    monkeypatch.setattr(dedup, "skip_re", re.compile("noisy line of the user's"))  # their RAY_DEDUP_LOGS_SKIP_REGEX
    dump = f"{WORKER_DEATH_DUMP}. To troubleshoot the problem, check the logs for the dead worker. Worker PID: 1"

    def printed(line: str) -> list[str]:
        batches = dedup.deduplicate({"lines": [line], "pid": "raylet", "is_err": False, "ip": "x", "job": ""})
        dedup.recent.clear()
        return [shown for batch in batches for shown in batch["lines"]]

    with worker_death_dumps_hidden():
        with worker_death_dumps_hidden():  # a second fit() at the same time, in another thread
            assert printed(dump) == [] and printed("a noisy line of the user's") == []
        assert printed(dump) == []  # the first fit() still runs
    assert printed(dump) == [dump]  # after fit(): Ray's own behaviour again
    assert printed("a noisy line of the user's") == []
