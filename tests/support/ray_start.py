"""A real `ray start --head` cluster for tests of the users' paths (Jobs, Jupyter, CLI).

Started the way a user starts one, with token authentication on
(`RAY_AUTH_MODE=token` and a token of the test's own in `RAY_AUTH_TOKEN`), on
free ports and in a temp dir of its own so it never collides with other Ray
instances on the machine. `ray stop` would stop every Ray on the machine, so
`stop()` ends only this cluster: the `ray start --block` process group it
launched, then any process whose command line names its temp dir.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = str(Path(sys.executable).parent)
_PORT_OPTIONS = (
    "--port",
    "--dashboard-port",
    "--ray-client-server-port",
    "--node-manager-port",
    "--object-manager-port",
    "--metrics-export-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
)
_WORKER_PORTS = 40


def _free_ports(count: int, avoid: range) -> list[int]:
    """`count` distinct ports the kernel says are free now (bound then released), none in `avoid`.

    `avoid` is the workers' port range: Ray refuses to start when a component's port falls in it.
    """
    socks, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)  # held until all are picked, so the kernel hands out distinct ports
            if s.getsockname()[1] not in avoid:
                ports.append(s.getsockname()[1])
            elif len(socks) > count + 1000:
                raise RuntimeError(f"no {count} free ports outside {avoid} found")
    finally:
        for s in socks:
            s.close()
    return ports


def _free_range(width: int) -> int:
    """The first port of `width` consecutive ports that are free now."""
    for base in range(20000 + secrets.randbelow(20000), 60000, width):
        socks = []
        try:
            for port in range(base, base + width):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no range of {width} free ports found for Ray's workers")


class RayStartCluster:
    """One head node started with `ray start --head --block`, stopped by `stop()`.

    It listens on `node_ip_address` (default loopback; tests/support/netns_cluster.py
    passes the address of its bridge, for worker nodes in other namespaces).
    """

    def __init__(
        self,
        num_cpus: int = 3,
        start_timeout: float = 90.0,
        node_ip_address: str = "127.0.0.1",
    ) -> None:
        # short: Ray puts unix sockets under the temp dir, and their paths are limited to 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="re-", dir="/tmp")
        self.token = secrets.token_hex(32)
        worker_base = _free_range(_WORKER_PORTS)
        worker_ports = range(worker_base, worker_base + _WORKER_PORTS)
        ports = dict(zip(_PORT_OPTIONS, _free_ports(len(_PORT_OPTIONS), avoid=worker_ports), strict=True))
        self.gcs_port = ports["--port"]
        self.dashboard_port = ports["--dashboard-port"]
        self.node_ip_address = node_ip_address
        self.address = f"{node_ip_address}:{self.gcs_port}"
        self.dashboard_url = f"http://{node_ip_address}:{self.dashboard_port}"
        self.env = {
            **os.environ,
            "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", ""),  # as an activated venv has it
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
        }
        for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
            self.env.pop(name, None)
        cmd = [
            os.path.join(VENV_BIN, "ray"),
            "start",
            "--head",
            "--block",
            f"--node-ip-address={node_ip_address}",
            f"--num-cpus={num_cpus}",
            "--include-dashboard=true",
            f"--dashboard-host={node_ip_address}",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_dir}",
            f"--min-worker-port={worker_base}",
            f"--max-worker-port={worker_base + _WORKER_PORTS - 1}",
            *(f"{option}={port}" for option, port in ports.items()),
        ]
        self.log_path = os.path.join(self.temp_dir, "ray-start.log")
        self._log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until the job server answers (the dashboard starts last) or `timeout` passes."""
        import requests

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}: {self.log()[-3000:]}")
            try:
                reply = requests.get(
                    f"{self.dashboard_url}/api/version",
                    headers={"Authorization": f"Bearer {self.token}"},
                    timeout=2,
                )
                if reply.ok:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray start's dashboard did not answer within {timeout:g} s: {self.log()[-3000:]}")
            time.sleep(0.5)

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def unhealthy(self, timeout: float = 10.0) -> str | None:
        """None while the dashboard answers within `timeout` s; else why not, with its log's tail.

        A session-long cluster can lose its dashboard to something outside the
        tests (the kernel's OOM killer on a crowded machine): the fixture then
        says so and starts a new cluster instead of failing every test after.
        """
        import requests

        if self.proc.poll() is not None:
            return f"ray start exited with {self.proc.returncode}: {self.log()[-2000:]}"
        try:
            reply = requests.get(
                f"{self.dashboard_url}/api/version",
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=timeout,
            )
            if reply.ok:
                return None
            problem = f"HTTP {reply.status_code}"
        except requests.RequestException as e:
            problem = repr(e)
        dashboard_log = Path(self.temp_dir, "session_latest", "logs", "dashboard.log")
        tail = dashboard_log.read_text(errors="replace")[-2000:] if dashboard_log.exists() else "(no dashboard.log)"
        return f"{self.dashboard_url}/api/version: {problem}; dashboard.log ends: {tail}"

    def run(self, args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run a command in the repository root with this cluster's environment, for at most `timeout` s."""
        return subprocess.run(
            args, cwd=REPO, env=env or self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def list_state(self, resource: str) -> list[dict]:
        """Ray's state API over HTTP (`actors`, `placement_groups`), as a user's tools see it.

        Over HTTP rather than `ray.util.state`, so the test process need not
        connect to this cluster (it is connected to the session's cluster).
        """
        import requests

        reply = requests.get(
            f"{self.dashboard_url}/api/v0/{resource}",
            params={"detail": "true", "limit": 10000},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=90,  # the dashboard answers its first queries slowly on a loaded machine; the tests read content
        )
        reply.raise_for_status()
        return reply.json()["data"]["result"]["result"]

    def run_actors(self, state: str = "ALIVE") -> list[dict]:
        """The actors of ray-elastic runs (namespaces `ray_elastic_*`) in `state`."""
        return [
            a
            for a in self.list_state("actors")
            if a["state"] == state and (a.get("ray_namespace") or "").startswith("ray_elastic_")
        ]

    def run_placement_groups(self) -> list[dict]:
        """The placement groups of ray-elastic runs that are not removed."""
        return [
            pg
            for pg in self.list_state("placement_groups")
            if pg["state"] != "REMOVED" and (pg.get("name") or "").startswith("ray_elastic_")
        ]

    def _own_processes(self) -> list[psutil.Process]:
        own = []
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if self.temp_dir in " ".join(proc.info["cmdline"] or ()):
                    own.append(proc)
            except psutil.Error:
                continue
        return own

    def stop(self, timeout: float = 20.0) -> None:
        """End this cluster's processes only, then remove its temp dir.

        SIGKILL, not a graceful stop: nothing of a test cluster needs saving,
        and `ray start --block` takes ~20 s to wind down on SIGTERM here.
        """
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout)
        # workers and agents that left the process group still name the temp dir on their command line
        leftovers = self._own_processes()
        for proc in leftovers:
            try:
                proc.kill()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(leftovers, timeout=timeout)
        self._log.close()
        if alive:
            raise RuntimeError(f"processes of the test's Ray cluster outlived SIGKILL: {[p.pid for p in alive]}")
        shutil.rmtree(self.temp_dir, ignore_errors=True)
