"""`ray-elastic run FILE.py:FUNCTION ...`: its help and its errors on bad input.

Help and bad input run `cli.main` in this process (they end before Ray is
touched); one bad input also goes through the installed `ray-elastic`
command to show that nothing starts. The real run is in integration/test_cli_cluster.py.
"""

from __future__ import annotations

import inspect
import os
import re
import time

import pytest
from ray_start import VENV_BIN

from ray_elastic import ElasticTrainer, cli

CLI = os.path.join(VENV_BIN, "ray-elastic")
# trainer arguments with a differently named option, or none: train_fn is the positional
# train_fn is the positional FILE.py:FUNCTION; Ray Datasets are objects a command line cannot carry
# (data_cpus and data_starvation_timeout act only on those datasets)
RENAMED = {
    "discovery": "--discovery-script",
    "train_fn": None,
    "datasets": None,
    "data_cpus": None,
    "data_starvation_timeout": None,
}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_help_names_every_trainer_option(capsys):
    code, out, _ = run_cli(capsys, "run", "--help")
    assert code == 0
    assert out.startswith("usage: ray-elastic run FILE.py:FUNCTION --min-workers N")
    for name in inspect.signature(ElasticTrainer).parameters:
        option = RENAMED.get(name, "--" + name.replace("_", "-"))
        if option is not None:
            assert option in out, f"ray-elastic run --help does not mention {option}"
    assert "--address" in out and "host:slots" in out


def test_top_level_help_lists_run(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert re.search(r"^\s+run\s+train FUNCTION\(config\)", out, re.MULTILINE), out


@pytest.fixture
def target(tmp_path) -> str:
    path = tmp_path / "cli_target.py"
    path.write_text("LIMIT = 3\n\ndef train(config):\n    return config\n\ndef two(a, b):\n    return a\n")
    return str(path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{dir}/cli_target"], "expected FILE.py:FUNCTION, MODULE:FUNCTION or SCRIPT.py"),
        (["{file}:train"], "the following arguments are required: --min-workers"),
        (["{dir}/missing.py:train", "--min-workers", "2"], "no such file"),
        (["{file}:nothing", "--min-workers", "2"], "has no 'nothing'"),
        (["{file}:LIMIT", "--min-workers", "2"], "is not callable"),
        (["{file}:two", "--min-workers", "2"], "must take one argument"),
        (["no_such_module_here:train", "--min-workers", "2"], "importing module no_such_module_here failed"),
        (["{file}:train", "--min-workers", "3", "--max-workers", "2"], "--max-workers (2) must be >= --min-workers"),
        (["{file}:train", "--min-workers", "0"], "--min-workers must be an integer >= 1"),
        (["{file}:train", "--min-workers", "two"], "argument --min-workers: invalid int value"),
        (["{file}:train", "--min-workers", "2", "--config", "epochs"], "expected KEY=VALUE, got 'epochs'"),
        (["--min-workers", "2", "--config", "a=1", "{file}:train"], "FILE.py:FUNCTION goes before the options"),
        (["{file}:train", "--min-workers", "2", "--resources-per-worker", "CPU=x"], "expected NAME=AMOUNT"),
        (["{file}:train", "--min-workers", "2", "--resources-per-worker", "CPU=0"], "all amounts are 0"),
        (["{file}:train", "--min-workers", "2", "--cooldown-range", "5", "1"], "--cooldown-range must be"),
        (["{file}:train", "--min-workers", "2", "--elastic-timeout", "0"], "--elastic-timeout must be a positive"),
        (["{file}:train", "--min-workers", "2", "--reset-limit", "-1"], "--reset-limit must be an integer >= 0"),
        (["{file}:train", "--min-workers", "2", "--backend", "mpi"], "invalid choice: 'mpi'"),
        (["{file}:train", "--min-workers", "2", "--discovery-script", "{dir}/nope.sh"], "does not exist"),
        (["{file}:train", "--min-workers", "2", "--discovery-script", "{file}"], "is not executable"),
        (["{file}:train", "--min-workers", "2", "--verbose", "3"], "argument --verbose: invalid choice"),
    ],
)
def test_bad_input_is_an_error_with_status_2(capsys, target, args, message):
    argv = ["run", *(a.format(file=target, dir=os.path.dirname(target)) for a in args)]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert "usage: ray-elastic run" in err
    assert message in err, err


def test_bad_input_exits_before_ray_starts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("def train(config):\n    return 1\n")
    start = time.monotonic()
    proc = cluster_free_run([CLI, "run", f"{script}:train", "--min-workers", "4", "--max-workers", "2"])
    assert proc.returncode == 2
    assert "--max-workers (2) must be >= --min-workers (4)" in proc.stderr
    assert "Ray" not in proc.stderr and time.monotonic() - start < 30


def test_unreachable_address_is_a_one_line_error_at_once(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "train.py"
    script.write_text("def train(config):\n    return 1\n")
    start = time.monotonic()
    proc = cluster_free_run([CLI, "run", f"{script}:train", "--min-workers", "1", "--address", f"127.0.0.1:{port}"])
    assert proc.returncode == 1
    assert f"cannot reach the Ray cluster at 127.0.0.1:{port}: ConnectionRefusedError" in proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - start < 30


def cluster_free_run(argv: list[str]):
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
