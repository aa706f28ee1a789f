"""Where workers may run: `{host: slots}` from Ray, a callable, or a script.

Three sources, one shape. Host keys are Ray node IDs; a user source may name
a node by IP where that IP is unique in the cluster (several local test nodes
share one IP, so there the node ID is required).

- `RayClusterDiscovery`: every alive node, with as many slots as its total
  resources hold copies of `resources_per_worker`.
- `CallableDiscovery`: the user's function returning `{host: slots}`.
- `ScriptDiscovery`: an executable printing `host:slots` lines, as Horovod's
  `--host-discovery-script` does (a bare `host` gets `default_slots`).

`KeepCpusFree` wraps any of them for a run given `datasets=`: it takes slots
away until whole CPUs are left free for Ray Data's read and map tasks
(`ElasticTrainer(data_cpus=...)`), since workers holding every CPU starve
the pipeline without a word.

`DiscoveryPoller` adds the failure policy: a source failing on its first call
fails the job at once with its error text; later failures are retried with a
warning until `give_up_after` seconds without a success.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass

from ray_elastic.exceptions import DiscoveryError

logger = logging.getLogger(__name__)

HostSlots = dict[str, int]
_REAP_S = 5.0  # a killed discovery script's pipes closing: a process that left its session may hold them


@dataclass(frozen=True)
class NodeInfo:
    """What discovery needs to know of one alive Ray node."""

    node_id: str
    ip: str
    resources: Mapping[str, float]


def slots_for_resources(node_resources: Mapping[str, float], per_worker: Mapping[str, float]) -> int:
    """How many workers of `per_worker` a node's total resources hold.

    The smallest `floor(node[r] / per_worker[r])` over requested resources;
    resources asked for in amount 0 are ignored.
    """
    counts = []
    for name, amount in per_worker.items():
        if amount <= 0:
            continue
        # a tiny epsilon absorbs Ray's fixed-point rounding (0.1 * 3 != 0.3)
        counts.append(math.floor(node_resources.get(name, 0.0) / amount + 1e-9))
    return max(0, min(counts)) if counts else 0


def parse_host_lines(text: str, default_slots: int = 1) -> HostSlots:
    """Parse Horovod's discovery format: one `host` or `host:slots` per line.

    Blank lines and `#` comments are skipped. A malformed line raises
    `DiscoveryError` naming it.
    """
    hosts: HostSlots = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, sep, slots_text = line.rpartition(":")
        if not sep:
            host, slots = line, default_slots
        else:
            try:
                slots = int(slots_text)
            except ValueError:
                raise DiscoveryError(f"line {lineno}: slots must be an integer in {raw!r}") from None
        host = host.strip()
        if not host or slots < 0 or any(c.isspace() for c in host):
            raise DiscoveryError(f"line {lineno}: expected 'host' or 'host:slots', got {raw!r}")
        hosts[host] = hosts.get(host, 0) + slots
    return hosts


def validate_host_slots(value: object, source: str) -> HostSlots:
    """Check that a user source returned `{str: int >= 0}`; raise otherwise."""
    if not isinstance(value, Mapping):
        raise DiscoveryError(f"{source} must return a dict of host -> slots, got {type(value).__name__}")
    out: HostSlots = {}
    for host, slots in value.items():
        if not isinstance(host, str) or not host:
            raise DiscoveryError(f"{source} returned a host key that is not a non-empty string: {host!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
            raise DiscoveryError(f"{source} returned slots {slots!r} for host {host!r}; expected an int >= 0")
        out[host] = slots
    return out


def resolve_hosts(
    raw: Mapping[str, int],
    nodes: Sequence[NodeInfo],
    per_worker: Mapping[str, float],
    unknown: list[str] | None = None,
) -> HostSlots:
    """Map user host keys (node IDs, unique IPs, or hostnames resolving to one) to node IDs.

    Slots are capped at what the node's resources hold, so a script cannot
    ask for placement groups that never fit. Hosts unknown to Ray are skipped
    (they may be about to join) and appended to `unknown`; an IP shared by
    several nodes is an error.
    """
    by_id = {n.node_id: n for n in nodes}
    by_ip: dict[str, list[NodeInfo]] = {}
    for n in nodes:
        by_ip.setdefault(n.ip, []).append(n)
    out: HostSlots = {}
    for host, slots in raw.items():
        node = by_id.get(host)
        if node is None:
            matches = by_ip.get(host) or []
            if not matches:
                address = _address_of(host)
                matches = by_ip.get(address, []) if address is not None else []
            if len(matches) > 1:
                raise DiscoveryError(
                    f"host {host!r} is the IP of {len(matches)} Ray nodes; name them by node ID instead"
                )
            if not matches:
                if unknown is not None:
                    unknown.append(host)
                continue
            node = matches[0]
        capacity = slots_for_resources(node.resources, per_worker)
        out[node.node_id] = min(capacity, out.get(node.node_id, 0) + slots)
    return out


def _address_of(host: str) -> str | None:
    """The IPv4 address a hostname resolves to (Horovod scripts print hostnames), or None."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return None


class _UnknownHosts:
    """What a user source named that is not an alive Ray node, warned about once per change."""

    def __init__(self) -> None:
        self.last: tuple[str, ...] = ()

    def update(self, hosts: list[str], source: object, nodes: Sequence[NodeInfo]) -> None:
        current = tuple(sorted(hosts))
        if current and current != self.last:
            known = ", ".join(f"{n.node_id[:8]} ({n.ip})" for n in nodes) or "none"
            logger.warning(
                "discovery from %r named hosts that are not alive Ray nodes, skipped until they join: %s "
                "(alive nodes: %s; name hosts by Ray node ID, IP or a hostname resolving to a node's IP)",
                source,
                ", ".join(current),
                known,
            )
        self.last = current


def alive_ray_nodes() -> list[NodeInfo]:
    """The alive nodes of the connected Ray cluster."""
    import ray

    return [
        NodeInfo(node_id=n["NodeID"], ip=n["NodeManagerAddress"], resources=dict(n["Resources"]))
        for n in ray.nodes()
        if n.get("Alive")
    ]


class RayClusterDiscovery:
    """Every alive Ray node, with the slots its total resources hold."""

    def __init__(self, per_worker: Mapping[str, float], nodes: Callable[[], list[NodeInfo]] = alive_ray_nodes):
        self.per_worker = dict(per_worker)
        self._nodes = nodes

    def __call__(self) -> HostSlots:
        hosts = {n.node_id: slots_for_resources(n.resources, self.per_worker) for n in self._nodes()}
        return {h: s for h, s in hosts.items() if s > 0}

    def __repr__(self) -> str:
        return "the Ray cluster"


class CallableDiscovery:
    """A user function returning `{host: slots}` (hosts: node IDs or IPs)."""

    def __init__(
        self,
        fn: Callable[[], Mapping[str, int]],
        per_worker: Mapping[str, float],
        nodes: Callable[[], list[NodeInfo]] = alive_ray_nodes,
    ):
        self.fn = fn
        self.per_worker = dict(per_worker)
        self._nodes = nodes
        self.unknown = _UnknownHosts()

    def __call__(self) -> HostSlots:
        raw = validate_host_slots(self.fn(), f"discovery callable {self!r}")
        return _resolve(raw, self._nodes(), self.per_worker, self.unknown, self)

    def __repr__(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


class ScriptDiscovery:
    """An executable printing `host:slots` lines; bounded by `timeout` seconds."""

    def __init__(
        self,
        path: str,
        per_worker: Mapping[str, float],
        default_slots: int = 1,
        timeout: float = 30.0,
        nodes: Callable[[], list[NodeInfo]] = alive_ray_nodes,
    ):
        # absolute: subprocess searches $PATH for a bare name, and the driver's cwd may differ
        self.path = os.path.abspath(path)
        self.per_worker = dict(per_worker)
        self.default_slots = default_slots
        self.timeout = timeout
        self._nodes = nodes
        self.unknown = _UnknownHosts()

    def __call__(self) -> HostSlots:
        try:
            # its own session, so a timeout kills whatever the script started too (kubectl, curl ...)
            proc = subprocess.Popen(
                [self.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
            )
        except OSError as e:
            raise DiscoveryError(f"discovery script {self.path} could not run: {e}") from None
        try:
            stdout, stderr = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            try:
                proc.communicate(timeout=_REAP_S)
            except subprocess.TimeoutExpired:  # a process that left the script's session holds its output open
                for pipe in (proc.stdout, proc.stderr):  # both PIPEs: never None here
                    if pipe is not None:
                        pipe.close()
                proc.wait(_REAP_S)
            raise DiscoveryError(f"discovery script {self.path} did not finish within {self.timeout:g} s") from None
        if proc.returncode != 0:
            raise DiscoveryError(
                f"discovery script {self.path} exited with {proc.returncode}: {stderr.strip()[-2000:]}"
            )
        raw = parse_host_lines(stdout, self.default_slots)
        return _resolve(raw, self._nodes(), self.per_worker, self.unknown, self)

    def __repr__(self) -> str:
        return f"script {self.path}"


def _resolve(
    raw: Mapping[str, int],
    nodes: Sequence[NodeInfo],
    per_worker: Mapping[str, float],
    seen: _UnknownHosts,
    source: object,
) -> HostSlots:
    unknown: list[str] = []
    hosts = resolve_hosts(raw, nodes, per_worker, unknown)
    seen.update(unknown, source, nodes)
    return hosts


def free_whole_cpus(hosts: Mapping[str, int], nodes: Sequence[NodeInfo], worker_cpus: float) -> int:
    """Whole CPUs no slot of `hosts` takes: a task asking for one CPU runs on one node, so fractions do not add up."""
    return sum(math.floor(n.resources.get("CPU", 0.0) - hosts.get(n.node_id, 0) * worker_cpus + 1e-9) for n in nodes)


def keep_cpus_free(
    hosts: Mapping[str, int],
    nodes: Sequence[NodeInfo],
    worker_cpus: float,
    keep: int,
    prefer: Sequence[str] = (),
) -> HostSlots:
    """`hosts` less the slots whose CPUs must stay free so that `keep` whole CPUs are left.

    CPUs no slot takes already count (a head node not offered, a node's
    remainder). A slot is taken from a host in `prefer` first (the hosts
    trimmed at the last poll, so a node joining does not move the free CPU
    and evict a worker elsewhere), then from the host closest to freeing a
    whole CPU, then from the host with the most slots.
    """
    out = dict(hosts)
    cpus = {n.node_id: n.resources.get("CPU", 0.0) for n in nodes}
    while worker_cpus > 0 and free_whole_cpus(out, nodes, worker_cpus) < keep:
        candidates = [h for h, slots in out.items() if slots > 0 and h in cpus]
        if not candidates:
            break
        host = min(
            candidates,
            key=lambda h: (h not in prefer, -((cpus[h] - out[h] * worker_cpus) % 1), -out[h], h),
        )
        out[host] -= 1
    return {h: s for h, s in out.items() if s > 0}


class KeepCpusFree:
    """A discovery source less the slots that would take the CPUs kept for Ray Data (`keep_cpus_free`)."""

    def __init__(
        self,
        source: Callable[[], HostSlots],
        keep: int,
        per_worker: Mapping[str, float],
        nodes: Callable[[], list[NodeInfo]] = alive_ray_nodes,
    ):
        self.source = source
        self.keep = keep
        self.worker_cpus = per_worker.get("CPU", 0.0)
        self._nodes = nodes
        self._trimmed: dict[str, int] = {}  # host -> slots taken away at the last poll

    def __call__(self) -> HostSlots:
        offered = self.source()
        hosts = keep_cpus_free(offered, self._nodes(), self.worker_cpus, self.keep, prefer=sorted(self._trimmed))
        trimmed = {h: s - hosts.get(h, 0) for h, s in offered.items() if s > hosts.get(h, 0)}
        if trimmed != self._trimmed:
            logger.info(
                "keeping %d CPU(s) free for Ray Data's tasks (data_cpus=%d): %d worker slot(s) of %d offered (%s)",
                self.keep,
                self.keep,
                sum(hosts.values()),
                sum(offered.values()),
                ", ".join(f"{h[:8]} -{s}" for h, s in sorted(trimmed.items())) or "none taken",
            )
        self._trimmed = trimmed
        return hosts

    def __repr__(self) -> str:
        return repr(self.source)


def make_discovery(
    spec: object, per_worker: Mapping[str, float], timeout: float = 30.0, keep_cpus: int = 0
) -> Callable[[], HostSlots]:
    """The discovery source for `ElasticTrainer(discovery=spec)`; a script is killed after `timeout` s.

    `keep_cpus` > 0 leaves that many whole CPUs of the cluster to no worker
    (`KeepCpusFree`): the run's `data_cpus` when it was given `datasets=`.
    """
    if spec is None:
        source: Callable[[], HostSlots] = RayClusterDiscovery(per_worker)
    elif isinstance(spec, (str, os.PathLike)):
        source = ScriptDiscovery(os.fspath(spec), per_worker, timeout=timeout)
    elif callable(spec):
        source = CallableDiscovery(spec, per_worker)
    else:
        raise ValueError(
            f"discovery must be None, a callable returning {{host: slots}}, or a script path; got {type(spec).__name__}"
        )
    return KeepCpusFree(source, keep_cpus, per_worker) if keep_cpus > 0 else source


def check_discovery_spec(spec: object) -> None:
    """Validate `discovery=` before anything is spawned."""
    if spec is None or callable(spec):
        return
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if not os.path.isfile(path):
            raise ValueError(f"discovery script {path!r} does not exist")
        if not os.access(path, os.X_OK):
            raise ValueError(f"discovery script {path!r} is not executable (chmod +x it)")
        return
    raise ValueError(
        f"discovery must be None, a callable returning {{host: slots}}, or a script path; got {type(spec).__name__}"
    )


class DiscoveryPoller:
    """Applies the failure policy around a discovery source.

    The first call's failure raises `DiscoveryError` at once. Afterwards a
    failure logs a warning and returns None (keep the last view), until
    `give_up_after` seconds have passed since the last success, when it raises.
    A call that does not answer within `timeout` seconds counts as a failure;
    while it hangs no second call is started (the next poll waits on it again).
    `last_success` (on `clock`) stands for a success before this poller
    existed: a restarted driver's, whose predecessor's view it keeps.
    """

    def __init__(
        self,
        source: Callable[[], HostSlots],
        give_up_after: float,
        timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        last_success: float | None = None,
    ):
        self.source = source
        self.give_up_after = give_up_after
        self.timeout = timeout
        self._clock = clock
        self._last_success = last_success
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ray-elastic-discovery")
        self._pending: Future | None = None

    def _call(self) -> HostSlots:
        if self._pending is None:
            self._pending = self._executor.submit(self.source)
        try:
            hosts = self._pending.result(timeout=self.timeout)
        except FutureTimeoutError:
            raise DiscoveryError(f"discovery from {self.source!r} did not answer within {self.timeout:g} s") from None
        finally:
            if self._pending is not None and self._pending.done():
                self._pending = None
        return hosts

    def poll(self) -> HostSlots | None:
        try:
            hosts = self._call()
        except Exception as e:  # the source is user code: any error is its report
            text = (
                str(e)
                if isinstance(e, DiscoveryError)
                else f"discovery from {self.source!r} failed: {type(e).__name__}: {e}"
            )
            if self._last_success is None:
                raise DiscoveryError(text) from e
            failing_for = self._clock() - self._last_success
            if failing_for > self.give_up_after:
                raise DiscoveryError(f"{text} (failing for {failing_for:.0f} s)") from e
            logger.warning("%s; retrying (failing for %.0f s)", text, failing_for)
            return None
        self._last_success = self._clock()
        return hosts
