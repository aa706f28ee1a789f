"""`ray-elastic run` of the Horovod scripts in support/horovod_scripts/ against the test cluster."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ray_start import VENV_BIN

from ray_elastic import cli

CLI = os.path.join(VENV_BIN, "ray-elastic")
SCRIPTS = Path(__file__).parent / "horovod_scripts"
REPO = Path(__file__).resolve().parents[2]


def launch(cluster, argv: list[str], **kwargs) -> subprocess.Popen:
    """`ray-elastic run ARGV` on the test cluster; `--address` goes before any `--` (what follows is the script's)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    launcher_args, script_args = cli.split_script_args(argv)
    return subprocess.Popen(
        [CLI, "run", *launcher_args, "--address", cluster.address, *(["--", *script_args] if script_args else [])],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )
