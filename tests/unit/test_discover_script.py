"""examples/discover.sh prints Horovod's `host:slots` lines that ray-elastic's discovery reads.

A user copies the sample script and edits its pool file: what it prints must
parse into the hosts and slots the file says, comments and blank lines
skipped, an empty pool an empty offer rather than an error, and without a
pool file one host (the machine it runs on) with one slot per CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ray_elastic.discovery import parse_host_lines

SCRIPT = Path(__file__).parents[2] / "examples" / "discover.sh"
pytestmark = pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")


def run(env: dict[str, str], script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(script)], env={**os.environ, **env}, capture_output=True, text=True, timeout=30)


def test_it_prints_the_pool_file_as_discovery_reads_it(tmp_path):
    pool = tmp_path / "pool.txt"
    pool.write_text("# the pool\n10.0.0.11:4\n\n   # a note\nnode-b\n10.0.0.11:2\n")
    done = run({"RAY_ELASTIC_HOSTS": str(pool)})
    assert done.returncode == 0, done.stderr
    assert parse_host_lines(done.stdout) == {"10.0.0.11": 6, "node-b": 1}


def test_an_empty_pool_is_an_empty_offer_not_a_failure(tmp_path):
    pool = tmp_path / "pool.txt"
    pool.write_text("# every host withdrawn\n")
    done = run({"RAY_ELASTIC_HOSTS": str(pool)})
    assert done.returncode == 0, done.stderr
    assert parse_host_lines(done.stdout) == {}


def test_the_pool_file_beside_the_script_is_read_by_default(tmp_path):
    script = tmp_path / "discover.sh"
    shutil.copy(SCRIPT, script)
    (tmp_path / "hosts.txt").write_text("10.0.0.12:3\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ELASTIC_HOSTS"}
    done = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert parse_host_lines(done.stdout) == {"10.0.0.12": 3}


@pytest.mark.skipif(shutil.which("hostname") is None or shutil.which("nproc") is None, reason="hostname, nproc")
def test_without_a_pool_file_it_offers_this_host_one_slot_per_cpu(tmp_path):
    done = run({"RAY_ELASTIC_HOSTS": str(tmp_path / "absent.txt")})
    assert done.returncode == 0, done.stderr
    hosts = parse_host_lines(done.stdout)
    assert len(hosts) == 1 and list(hosts.values()) == [len(os.sched_getaffinity(0))], done.stdout
