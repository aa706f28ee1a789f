"""horovod.ray's elastic names: `ElasticRayExecutor`, `RayHostDiscovery`, `TestDiscovery`, `HostDiscovery`.

`ElasticRayExecutor` is horovod.ray's older elastic API (settings from
`create_settings(min_num_proc=..., max_num_proc=...)`, then `start()` and
`run(worker_fn)`); each `run()` is one elastic `ElasticTrainer.fit()` with
fresh workers, whose result is the value of every worker that finished, in
rank order.

Discovery: `override_discovery=True` (the default) uses ray-elastic's own
view of the Ray cluster (alive nodes, their slots, draining nodes left
out). A `HostDiscovery` set as `settings.discovery` is polled by the run's
driver actor, where it is shipped pickled: it keeps its state there (as
`TestDiscovery`'s schedule needs), not in the script's copy.
`RayHostDiscovery` names hosts by Ray node ID, not by IP as horovod.ray
does: several nodes may share an IP (one machine, containers), and
ray-elastic's hosts are nodes; an IP is still accepted where it is unique.
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.discovery import slots_for_resources
from ray_elastic.horovod.ray import settings as s
from ray_elastic.horovod.ray.runner import DEFAULT_COOLDOWN, ensure_ray, trainer_discovery
from ray_elastic.horovod.ray.sessions import run_elastic
from ray_elastic.options import from_horovod

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)


class HostDiscovery:
    """Horovod's discovery interface: `find_available_hosts_and_slots()` returns `{host: slots}`."""

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        raise NotImplementedError


class RayHostDiscovery(HostDiscovery):
    """Every alive node of the Ray cluster, keyed by node ID, with the slots its resources hold.

    Args:
        use_gpu: count GPU slots too (the smaller count wins).
        cpus_per_slot, gpus_per_slot: one worker's CPUs and GPUs (horovod.ray's
            `elastic_v2` calls them `cpus_per_worker`, `gpus_per_worker`:
            accepted by those names too).
    """

    def __init__(
        self,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float = 1,
        *,
        cpus_per_worker: float | None = None,
        gpus_per_worker: float | None = None,
    ) -> None:
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot if cpus_per_worker is None else cpus_per_worker
        self.gpus_per_slot = gpus_per_slot if gpus_per_worker is None else gpus_per_worker
        self.per_worker = {"CPU": float(self.cpus_per_slot)}
        if use_gpu:
            self.per_worker["GPU"] = float(self.gpus_per_slot or 1)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        hosts = {n["NodeID"]: slots_for_resources(n["Resources"], self.per_worker) for n in ray.nodes() if n["Alive"]}
        return {host: slots for host, slots in hosts.items() if slots > 0}


class TestDiscovery(RayHostDiscovery):
    """The Ray cluster's hosts with one host withdrawn or given back every `change_frequency_s` seconds.

    As horovod.ray's: at or below `min_hosts` offered hosts one withdrawn
    host comes back, at or above `max_hosts` one more is withdrawn, in
    between either, at random. Withdrawn hosts are left out of what it
    returns (their workers leave gracefully at their next commit); nothing
    is killed. `_graceful=False` (horovod.ray kills a node through the
    autoscaler's config file) is refused: remove a node of the cluster or
    kill a worker instead. `seed` (not in horovod.ray) fixes the choices.
    """

    __test__ = False  # a discovery, not a pytest test class

    def __init__(
        self,
        min_hosts: int,
        max_hosts: int,
        change_frequency_s: float,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float = 1,
        verbose: bool = True,
        _graceful: bool = True,
        *,
        cpus_per_worker: float | None = None,
        gpus_per_worker: float | None = None,
        seed: int | None = None,
    ) -> None:
        if not _graceful:
            raise ValueError(
                "TestDiscovery(_graceful=False) kills a node through ~/ray_bootstrap_config.yaml in horovod.ray; "
                "ray-elastic does not: remove a node (or SIGKILL a worker) to test a loss"
            )
        if s.check_count("min_hosts", min_hosts, 0) > s.check_count("max_hosts", max_hosts, 1):
            raise ValueError(f"min_hosts ({min_hosts}) must be <= max_hosts ({max_hosts})")
        super().__init__(
            use_gpu, cpus_per_slot, gpus_per_slot, cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker
        )
        self._min_hosts = min_hosts
        self._max_hosts = max_hosts
        self._change_frequency_s = s.check_seconds("change_frequency_s", change_frequency_s)
        self.verbose = verbose
        self._removed_hosts: set[str] = set()
        self._last_change: float | None = None
        self._rng = random.Random(seed)

    def add_host(self, hosts: dict[str, int]) -> None:
        """Give one withdrawn host back."""
        back = sorted(self._removed_hosts & hosts.keys())
        if back:
            self._removed_hosts.discard(self._rng.choice(back))
        elif self.verbose:
            print("No hosts to add.")

    def remove_host(self, hosts: dict[str, int]) -> None:
        """Withdraw one host still offered."""
        offered = sorted(h for h in hosts if h not in self._removed_hosts)
        if offered:
            self._removed_hosts.add(self._rng.choice(offered))

    def change_hosts(self, hosts: dict[str, int]) -> None:
        self._removed_hosts &= hosts.keys()  # a host gone from the cluster is no longer withdrawn
        offered = len(hosts) - len(self._removed_hosts)
        if offered <= self._min_hosts:
            self.add_host(hosts)
        elif offered >= self._max_hosts:
            self.remove_host(hosts)
        elif self._rng.random() < 0.5:
            self.add_host(hosts)
        else:
            self.remove_host(hosts)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        now = time.time()
        hosts = super().find_available_hosts_and_slots()
        if self._last_change is None:
            self._last_change = now
        elif now - self._last_change >= self._change_frequency_s:
            self.change_hosts(hosts)
            self._last_change = now
        remaining = {h: n for h, n in hosts.items() if h not in self._removed_hosts}
        if self.verbose:
            print(f"Total hosts: {len(hosts)}; remaining hosts: {len(remaining)} -- {remaining}")
        return remaining


class ElasticRayExecutor:
    """horovod.ray's older elastic executor.

    Args:
        settings: from `ElasticRayExecutor.create_settings()`.
        use_gpu: one GPU per worker (or `gpus_per_slot`).
        cpus_per_slot: CPUs per worker (default 1).
        gpus_per_slot: GPUs per worker; needs `use_gpu`.
        env_vars: environment variables set in every worker before it joins.
        override_discovery: True sets `settings.discovery` to a
            `RayHostDiscovery` and finds hosts in the Ray cluster; False uses
            the `settings.discovery` the caller set.
    """

    @staticmethod
    def create_settings(
        min_num_proc: int = 1,
        max_num_proc: int | None = None,
        reset_limit: int | None = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        nics: set[str] | None = None,
        min_np: int | None = None,
        max_np: int | None = None,
        **kwargs: Any,
    ) -> s.ElasticSettings:
        """The run's bounds and timeouts; also takes Horovod's `cooldown_range` and `verbose`.

        `timeout_s` bounds forming the ring (the collective timeout); other
        Horovod settings (`ssh_*`, `key`, ...) warn, unknown names raise.
        """
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning, 2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning, 2)
            max_num_proc = max_np
        cooldown_range = kwargs.pop("cooldown_range", None)
        verbose = kwargs.pop("verbose", 1)
        s.refuse_unknown("ElasticRayExecutor.create_settings", kwargs)
        s.warn_no_counterpart("ElasticRayExecutor.create_settings", {"ssh_identity_file": ssh_identity_file})
        s.check_count("min_num_proc", min_num_proc)
        if max_num_proc is not None and s.check_count("max_num_proc", max_num_proc) < min_num_proc:
            raise ValueError(f"max_num_proc ({max_num_proc}) must be >= min_num_proc ({min_num_proc})")
        if reset_limit is not None:
            s.check_count("reset_limit", reset_limit, 0)
        return s.ElasticSettings(
            min_num_proc=min_num_proc,
            max_num_proc=max_num_proc,
            reset_limit=reset_limit,
            elastic_timeout=s.check_seconds("elastic_timeout", elastic_timeout),
            timeout_s=s.check_seconds("timeout_s", timeout_s),
            ssh_identity_file=ssh_identity_file,
            nics=s.check_nics(nics),
            cooldown_range=cooldown_range,
            verbose=verbose,
            num_proc=min_num_proc,
        )

    def __init__(
        self,
        settings: Any,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: int | None = None,
        env_vars: dict[str, Any] | None = None,
        override_discovery: bool = True,
    ) -> None:
        self.resources = s.worker_resources(
            "ElasticRayExecutor", cpus_per_slot, use_gpu, gpus_per_slot, "gpus_per_slot"
        )
        self.env = {**s.check_env("env_vars", env_vars), **s.gloo_env(s.check_nics(settings.nics))}
        self.override_discovery = override_discovery
        if override_discovery:
            settings.discovery = RayHostDiscovery(use_gpu, cpus_per_slot, gpus_per_slot or 1)
        else:
            trainer_discovery(settings.discovery)  # missing or unusable: said now
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        self._started = False

    def start(self) -> None:
        """Connect to Ray (or start it); the workers start with each `run()`, once `min_num_proc` slots exist."""
        ensure_ray()
        self._started = True

    def run(self, worker_fn: Callable[[], Any], callbacks: list[Callable[[Any], Any]] | None = None) -> list[Any]:
        """`worker_fn()` on every worker, elastically; the values of every worker that finished, in rank order.

        `callbacks` receive each dict rank 0 logs (`ray_logger.log`) as it arrives.
        """
        if not callable(worker_fn):
            raise ValueError(f"worker_fn must be callable, got {type(worker_fn).__name__}")
        if not self._started:
            raise RuntimeError("call start() before run()")
        st = self.settings
        max_workers = st.max_num_proc
        if max_workers is None:  # "unbounded": what the cluster holds now
            max_workers = max(
                st.min_num_proc, sum(RayHostDiscovery(**self._slot_kwargs()).find_available_hosts_and_slots().values())
            )
        trainer_kwargs = {
            "cooldown_range": DEFAULT_COOLDOWN,
            **from_horovod(st),  # min_num_proc, reset_limit, elastic_timeout, timeout_s, cooldown_range
            "max_workers": max_workers,
            "resources_per_worker": self.resources,
            "discovery": None if self.override_discovery else trainer_discovery(st.discovery),
            "verbose": int(bool(st.verbose)),
        }
        return run_elastic(_call_without_executable(worker_fn), self.env, (None, [], {}), callbacks, trainer_kwargs)

    def _slot_kwargs(self) -> dict[str, Any]:
        return {"use_gpu": self.use_gpu, "cpus_per_slot": self.cpus_per_slot, "gpus_per_slot": self.gpus_per_slot or 1}


def _call_without_executable(worker_fn: Callable[[], Any]) -> Callable[[Any], Any]:
    def command(_executable: Any) -> Any:
        return worker_fn()

    return command
