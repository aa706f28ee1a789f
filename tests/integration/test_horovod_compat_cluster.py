"""Horovod scripts run for real: `python SCRIPT.py` says how to launch it, and the installed `ray-elastic run`
against the test cluster runs support/horovod_scripts/api_check.py (a Horovod script with one import line
changed): every collective of the API checked on two ranks.
"""

from __future__ import annotations

import re
import subprocess
import sys

from horovod_launch import SCRIPTS, launch


def test_running_a_script_with_python_directly_says_how_to_launch_it():
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "api_check.py")], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1
    assert "hvd.init() works inside a worker started by the launcher" in proc.stderr


def test_every_api_call_of_a_horovod_script_on_two_ranks(cluster, no_leaks):
    proc = launch(cluster, [str(SCRIPTS / "api_check.py"), "-np", "2"])
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, (out + err)[-5000:]
    assert "[0]<stdout>:api ok rank 0 of 2" in out.splitlines(), out[-3000:]
    assert "[1]<stdout>:api ok rank 1 of 2" in out.splitlines(), out[-3000:]
    assert re.search(r"^ray-elastic: finished in [\d.]+ s with 0 reset\(s\)$", out, re.MULTILINE), out[-3000:]
    assert "return value" not in out
