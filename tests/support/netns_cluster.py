"""A Ray cluster whose worker nodes each have an IP of their own, in Linux network namespaces.

The head runs in the root namespace, bound to the address of a bridge this
class creates; each worker node runs `ray start` inside a network namespace
of its own, joined to the bridge by a veth pair. So ranks on different nodes
talk over real, distinct addresses, and a node can be cut off silently
(`cut`: every packet on its veth dropped, no RST, as when a VM vanishes) and
healed, or its link capped at a NIC's speed (`shape`). Needs root
(CAP_NET_ADMIN): `unavailable_reason()` says why not.

Everything created is named with one prefix (`re` + 4 random hex digits):
the bridge, the veths, the namespaces, on a /24 of 10.213.0.0/16 that no
route here covers. Processes are stopped by PID only: the head's through
`RayStartCluster.stop`, a node's as the PIDs inside its namespace (every
process in it is one this class started). `close()` removes it all, is
idempotent and runs at exit too, so a crashed test leaves nothing behind.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from ray_start import VENV_BIN, RayStartCluster

_NODE_CPUS = 2
# a worker node's ports, inside its own namespace where every port is free
_NODE_PORTS = {
    "--node-manager-port": 41000,
    "--object-manager-port": 41001,
    "--metrics-export-port": 41002,
    "--dashboard-agent-listen-port": 41003,
    "--dashboard-agent-grpc-port": 41004,
    "--runtime-env-agent-port": 41005,
}
_NODE_WORKER_PORTS = (42000, 42099)


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def _tc(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [*(["ip", "netns", "exec", netns] if netns else []), "tc", *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (no `ip`, not root, no CAP_NET_ADMIN), or None."""
    name = f"re{secrets.token_hex(2)}probe"
    try:
        made = _ip("netns", "add", name, check=False)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    if made.returncode != 0:
        return f"`ip netns add` failed (needs root or CAP_NET_ADMIN): {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _free_subnet() -> str:
    """The first three octets of a 10.213.x.0/24 that no route or address here covers."""
    for _ in range(100):
        net = f"10.213.{secrets.randbelow(256)}"
        routes = _ip("-4", "route", "show", "match", f"{net}.0/24").stdout.splitlines()
        if not [r for r in routes if not r.startswith("default")]:
            return net
    raise RuntimeError("no free /24 in 10.213.0.0/16")


@dataclass
class NetnsNode:
    """One worker node: its namespace, its address, the veth pair that joins it to the bridge."""

    index: int
    netns: str
    ip: str
    host_veth: str  # on the bridge, in the root namespace
    node_veth: str  # inside the namespace, holding `ip`
    proc: subprocess.Popen
    log_path: str
    cut_with: str | None = None  # the qdisc that cuts it off now, if cut

    def pids(self) -> list[int]:
        """The processes inside this node's namespace: all of them are this node's Ray processes."""
        out = _ip("netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]


class NetnsCluster:
    """A `ray start` head on a bridge and `num_nodes` worker nodes of 2 CPUs, each in its own namespace."""

    def __init__(self, num_nodes: int = 2, start_timeout: float = 90.0) -> None:
        self.prefix = f"re{secrets.token_hex(2)}"
        self.bridge = f"{self.prefix}br"
        self.subnet = _free_subnet()
        self.bridge_ip = f"{self.subnet}.1"
        self.nodes: list[NetnsNode] = []
        self.head: RayStartCluster | None = None
        self._next_index = 0
        self._netns_made: list[str] = []
        self._veths_made: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            self.head = RayStartCluster(num_cpus=0, start_timeout=start_timeout, node_ip_address=self.bridge_ip)
            for _ in range(num_nodes):
                self.add_node(start_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """The GCS address, for `ray.init(address=...)` or RAY_ADDRESS."""
        assert self.head is not None
        return self.head.address

    @property
    def env(self) -> dict[str, str]:
        """The environment of a driver that connects to this cluster (token auth included)."""
        assert self.head is not None
        return {**self.head.env, "RAY_ADDRESS": self.address}

    @property
    def node_ips(self) -> list[str]:
        return [n.ip for n in self.nodes]

    def alive_nodes(self) -> dict[str, str]:
        """`{node_ip: node_id}` of the nodes Ray's GCS counts as alive (the head included)."""
        assert self.head is not None
        return {n["node_ip"]: n["node_id"] for n in self.head.list_state("nodes") if n["state"] == "ALIVE"}

    def node_ids(self) -> dict[str, str]:
        """`{node_ip: node_id}` of the alive worker nodes."""
        return {ip: node_id for ip, node_id in self.alive_nodes().items() if ip != self.bridge_ip}

    def add_node(self, start_timeout: float = 90.0) -> NetnsNode:
        """Start one more worker node in a new namespace; return once the GCS counts it alive."""
        assert self.head is not None
        index = self._next_index
        self._next_index += 1
        netns, ip = f"{self.prefix}n{index}", f"{self.subnet}.{10 + index}"
        host_veth, node_veth = f"{self.prefix}h{index}", f"{self.prefix}v{index}"
        # created first, so that close() removes it even if what follows fails
        _ip("netns", "add", netns)
        self._netns_made.append(netns)
        self._veths_made.append(host_veth)
        _ip("link", "add", host_veth, "type", "veth", "peer", "name", node_veth, "netns", netns)
        _ip("link", "set", host_veth, "master", self.bridge, "up")
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("addr", "add", f"{ip}/24", "dev", node_veth, netns=netns)
        _ip("link", "set", node_veth, "up", netns=netns)
        # no GLOO_SOCKET_IFNAME: the rings must find the node's address by themselves (the hostname resolves
        # to loopback here, as on many Debian/Ubuntu hosts)
        env = dict(self.head.env)
        cmd = [
            "ip", "netns", "exec", netns,  # execs ray in place: the PID is ray start's own
            os.path.join(VENV_BIN, "ray"), "start", "--block",
            f"--address={self.address}",
            f"--node-ip-address={ip}",
            f"--num-cpus={_NODE_CPUS}",
            "--disable-usage-stats",
            f"--temp-dir={self.head.temp_dir}",
            f"--min-worker-port={_NODE_WORKER_PORTS[0]}",
            f"--max-worker-port={_NODE_WORKER_PORTS[1]}",
            *(f"{option}={port}" for option, port in _NODE_PORTS.items()),
        ]  # fmt: skip
        log_path = os.path.join(self.head.temp_dir, f"node-{index}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        node = NetnsNode(index, netns, ip, host_veth, node_veth, proc, log_path)
        self.nodes.append(node)
        deadline = time.monotonic() + start_timeout
        while ip not in self.alive_nodes():
            if proc.poll() is not None:
                raise RuntimeError(f"ray start in {netns} exited with {proc.returncode}: {self.log(node)[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {ip} did not join within {start_timeout:g} s: {self.log(node)[-3000:]}")
            time.sleep(0.5)
        return node

    def log(self, node: NetnsNode) -> str:
        return Path(node.log_path).read_text(errors="replace")

    def cut(self, node: NetnsNode) -> str:
        """Drop every packet to and from `node`, silently (no RST, no error to a sender); returns how.

        netem loss 100% where the kernel has netem; the blackhole qdisc (drops
        everything, reports success) where it has not, as on this project's VMs.
        """
        for qdisc in (["netem", "loss", "100%"], ["blackhole"]):
            added = _tc("qdisc", "add", "dev", node.host_veth, "root", *qdisc, check=False)
            if added.returncode == 0:
                _tc("qdisc", "add", "dev", node.node_veth, "root", *qdisc, netns=node.netns)
                node.cut_with = qdisc[0]
                return qdisc[0]
        raise RuntimeError(f"no qdisc to cut {node.ip} off: {added.stderr.strip()}")

    def shape(self, node: NetnsNode, gbit: float) -> None:
        """Cap `node`'s link at `gbit` Gbit/s each way, as a NIC of that speed would (a token bucket on both ends).

        Traffic between two ranks on one node stays on its own loopback. Not to be combined with `cut`;
        `heal` removes the cap.
        """
        for dev, netns in ((node.host_veth, None), (node.node_veth, node.netns)):
            # a burst of 4 MB: at 10 Gbit/s that is 3 ms of traffic, well above a GSO segment and the timer's tick
            _tc("qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit", "burst", "4mb",
                "latency", "50ms", netns=netns)  # fmt: skip

    def heal(self, node: NetnsNode) -> None:
        """Undo `cut`: both ends pass packets again."""
        _tc("qdisc", "del", "dev", node.host_veth, "root", check=False)
        _tc("qdisc", "del", "dev", node.node_veth, "root", netns=node.netns, check=False)
        node.cut_with = None

    def kill_node(self, node: NetnsNode, timeout: float = 20.0) -> None:
        """SIGKILL every Ray process of `node` (its raylet, agents and workers), by PID."""
        procs = []
        for pid in node.pids():
            try:
                procs.append(psutil.Process(pid))
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, psutil.NoSuchProcess):
                continue
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        node.proc.wait(timeout)
        if alive:
            raise RuntimeError(f"processes of node {node.ip} outlived SIGKILL: {[p.pid for p in alive]}")

    def close(self) -> None:
        """Kill every process started, then remove the namespaces, veths (with their qdiscs) and bridge."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for node in self.nodes:
            try:
                self.kill_node(node)
            except Exception as e:
                errors.append(e)
        for netns in self._netns_made:
            # deleting the namespace deletes the veth end inside it, and so its peer on the bridge
            _ip("netns", "del", netns, check=False)
        for veth in self._veths_made:
            _ip("link", "del", veth, check=False)  # gone already unless the namespace lingered
        if self.head is not None:
            try:
                self.head.stop()
            except Exception as e:
                errors.append(e)
        _ip("link", "del", self.bridge, check=False)
        atexit.unregister(self.close)
        if errors:
            raise RuntimeError(f"closing the netns cluster: {errors}")
