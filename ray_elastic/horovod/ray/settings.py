"""horovod.ray's settings objects, and how each of their fields maps onto ray-elastic.

`RayExecutor.create_settings(...)` returns a `MiniSettings` and
`ElasticRayExecutor.create_settings(...)` an `ElasticSettings`, with
horovod.ray's field names, so a script that sets `settings.discovery = ...`
or reads `settings.verbose` keeps working. Nothing here starts Ray: every
check runs before a worker is spawned.

Fields with no counterpart (ssh: ray-elastic starts its workers through
Ray, never over ssh) are accepted with a warning naming them; `nics` maps
onto the one thing it can mean here, the interface Gloo's ring uses
(`GLOO_SOCKET_IFNAME`), and more than one interface is refused.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# the worker environment variable torch Gloo (and ray-elastic's address choice) reads
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


class HorovodRayWarning(UserWarning):
    """A horovod.ray argument accepted but without effect here; the message names it and says why."""


@dataclass
class MiniSettings:
    """`RayExecutor.create_settings()`'s result (horovod.ray's `MiniSettings`).

    - `timeout_s`: seconds forming the ring, or one collective, may take
      (horovod: the Gloo rendezvous timeout; ray-elastic's `collective_timeout`).
    - `placement_group_timeout_s`: seconds to wait for the cluster to place
      the workers. With `timeout_s`, it bounds a static `start()`.
    - `nics`: one network interface for the ring, or None for the interface
      that carries the node's IP.
    - `verbose`: 0 hides the progress and event lines, 1 shows them.
    - `discovery`: read in elastic mode when `override_discovery=False`.
    - `ssh_port`, `ssh_identity_file`, `key`: horovod.ray's fields, kept so a
      script that sets them runs; the executor warns naming any that is set
      (no ssh; the run's actors share a secret of their own).
    - `start_timeout`: horovod's `Timeout` object; reading it raises, naming
      `timeout_s` and `placement_group_timeout_s`, which bound the start here.
    """

    nics: set[str] | None = None
    verbose: int = 1
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: float = 300
    placement_group_timeout_s: float = 100
    elastic: bool = False
    discovery: Any = None

    @property
    def start_timeout(self) -> Any:
        raise AttributeError(
            "MiniSettings.start_timeout (horovod's Timeout object) has no counterpart in ray-elastic: "
            "timeout_s and placement_group_timeout_s bound the start"
        )


@dataclass
class ElasticSettings:
    """`ElasticRayExecutor.create_settings()`'s result (Horovod's `ElasticSettings`, its fields used here).

    `num_proc` is `min_num_proc`, as in Horovod. `discovery` is set by the
    executor (override_discovery=True) or by the user (a `HostDiscovery`,
    e.g. `TestDiscovery`; a callable returning `{host: slots}`; or the path
    of a script printing `host:slots` lines).
    """

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    ssh_identity_file: str | None = None
    nics: set[str] | None = None
    cooldown_range: tuple[float, float] | None = None
    verbose: int = 1
    discovery: Any = None
    num_proc: int = 1
    elastic: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


# Horovod settings fields with no counterpart here, and why
_NO_COUNTERPART = {
    "ssh_port": "ray-elastic starts its workers through Ray, not over ssh",
    "ssh_identity_file": "ray-elastic starts its workers through Ray, not over ssh",
    "ssh_str": "ray-elastic starts its workers through Ray, not over ssh; the key was not written",
    "key": "the run's actors share a secret of their own (ray_elastic.auth)",
    "output_filename": "worker output goes to Ray's logs and the driver's terminal",
    "prefix_output_with_timestamp": "worker output goes to Ray's logs and the driver's terminal",
    "extra_mpi_args": "no MPI: the ring is Gloo (or NCCL on GPUs)",
    "binding_args": "no MPI: the ring is Gloo (or NCCL on GPUs)",
    "tcp_flag": "no MPI: the ring is Gloo (or NCCL on GPUs)",
    "run_func_mode": "the function is always run in ray-elastic's worker actors",
}


def warn_no_counterpart(where: str, given: Mapping[str, Any]) -> None:
    """One warning naming every argument in `given` that is set (not None/False) but has no counterpart."""
    ignored = [f"{name} ({_NO_COUNTERPART[name]})" for name, value in given.items() if value not in (None, False)]
    if ignored:
        warnings.warn(f"{where}: ignored, no counterpart in ray-elastic: {'; '.join(ignored)}", HorovodRayWarning, 3)


def refuse_unknown(where: str, extra: Mapping[str, Any]) -> None:
    """Horovod's settings take **kwargs; a name neither used nor known to be moot is an error naming it."""
    moot = {k: v for k, v in extra.items() if k in _NO_COUNTERPART}
    unknown = sorted(set(extra) - set(moot))
    if unknown:
        raise TypeError(f"{where}: unexpected argument(s) {unknown}: not a Horovod setting ray-elastic knows")
    warn_no_counterpart(where, moot)


def check_nics(nics: Any) -> set[str] | None:
    """`nics` as a set of one interface name, or None; several interfaces are refused (the ring uses one)."""
    if nics is None:
        return None
    names = {nics} if isinstance(nics, str) else set(nics) if isinstance(nics, Iterable) else None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"nics must be a set of network interface names, got {nics!r}")
    if len(names) > 1:
        raise ValueError(
            f"nics={sorted(names)}: ray-elastic's Gloo ring uses one interface (GLOO_SOCKET_IFNAME); pass one"
        )
    return names or None


def gloo_env(nics: set[str] | None) -> dict[str, str]:
    """The worker environment that makes the ring use `nics`' interface."""
    return {GLOO_IFNAME: next(iter(nics))} if nics else {}


def check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def worker_resources(where: str, cpus: Any, use_gpu: bool, gpus: Any, gpu_name: str) -> dict[str, float]:
    """One worker's Ray resources, with horovod.ray's checks (`gpus_*` needs `use_gpu`, at least 1)."""
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus < 0:
        raise ValueError(f"{where}: CPUs per worker must be a number >= 0, got {cpus!r}")
    if gpus and not use_gpu:
        raise ValueError(f"{where}: {gpu_name} is set, but use_gpu is False: use_gpu must be True if {gpu_name} is set")
    if use_gpu and gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or gpus < 1):
        raise ValueError(f"{where}: {gpu_name} must be >= 1, got {gpus!r}")
    resources = {"CPU": float(cpus)}
    if use_gpu:
        resources["GPU"] = float(gpus or 1)
    if not any(resources.values()):
        raise ValueError(f"{where}: a worker must ask for some resource (0 CPUs and no GPU)")
    return resources


def check_env(name: str, env: Any) -> dict[str, str]:
    """Environment variables for the workers: a dict of names to values (made strings, as horovod.ray does)."""
    if env is None:
        return {}
    if not isinstance(env, Mapping) or not all(isinstance(k, str) and k for k in env):
        raise ValueError(f"{name} must be a dict of environment variable names to values, got {env!r}")
    return {k: str(v) for k, v in env.items()}
