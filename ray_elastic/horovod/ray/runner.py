"""`RayExecutor`: horovod.ray's executor, static or elastic, on ray-elastic's workers.

Static (`num_workers=N`, or `num_hosts * num_workers_per_host`): `start()`
starts N workers that join one ring and build the executable, and they
persist until `shutdown()`: every `run`/`execute`/`execute_single`/
`run_remote` is a command to the same workers, so an executable's state and
the ring outlive a call, as horovod.ray's actors do (Ray Tune's Horovod
trainable calls `execute` once per step and relies on it). Starting workers
per call instead would re-import torch and re-form the ring each time.

Elastic (`min_workers`, optionally `max_workers`): each `run()`/`execute()`
is one elastic run with fresh workers, as horovod.ray's elastic adapter
starts them per run; `run_remote` and `execute_single` are refused, as there.

How each argument maps is said where it is read; see
docs/migrating-from-horovod.md ("From horovod.ray").
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.discovery import RayClusterDiscovery
from ray_elastic.horovod.ray import settings as s
from ray_elastic.horovod.ray.sessions import StaticSession, run_elastic
from ray_elastic.horovod.ray.settings import MiniSettings
from ray_elastic.horovod.ray.worker_loop import call_with
from ray_elastic.options import from_horovod

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

DEFAULT_COOLDOWN = (10.0, 300.0)  # horovod.ray's None; ray-elastic's own default (hosts are offered again)


class RayExecutor:
    """Run a function on Ray workers in one Horovod ring (horovod.ray's `RayExecutor`).

    Args:
        settings: from `RayExecutor.create_settings()`.
        num_workers: static world size.
        num_hosts: with `num_workers_per_host`, the static world size
            `num_hosts * num_workers_per_host`: exactly `num_workers_per_host`
            workers on each of `num_hosts` nodes, as horovod.ray's
            STRICT_SPREAD placement does (ranks are contiguous per node, nodes
            oldest first); a node whose resources hold fewer is not used,
            and `start()` raises `TimeoutError` naming both numbers when
            fewer than `num_hosts` nodes hold that many (or have them free).
        num_workers_per_host: see `num_hosts` (default 1).
        cpus_per_worker: CPUs per worker (default 1).
        use_gpu: one GPU per worker (or `gpus_per_worker`); NCCL then carries the ring.
        gpus_per_worker: GPUs per worker; needs `use_gpu`.
        use_current_placement_group: horovod.ray places its workers in the
            caller's placement group; ray-elastic places each worker in a
            placement group of its own (a warning says so when the caller is
            inside one).
        min_workers: elastic mode: training runs with at least this many.
        max_workers: elastic mode: at most this many (None: the slots the
            cluster holds when `run()` starts).
        reset_limit: elastic mode: fail after this many resets (None: no limit).
        cooldown_range: elastic mode: (min, max) seconds a host whose worker
            failed is held back (None: ray-elastic's (10, 300)).
        elastic_timeout: elastic mode: seconds to wait for `min_workers`.
        override_discovery: elastic mode: True finds hosts in the Ray cluster;
            False reads `settings.discovery` (e.g. a `TestDiscovery`).
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: set[str] | None = None,
    ) -> MiniSettings:
        """horovod.ray's settings: the start timeouts and the ring's interface (ssh arguments warn: no ssh here)."""
        s.warn_no_counterpart(
            "RayExecutor.create_settings", {"ssh_identity_file": ssh_identity_file, "ssh_str": ssh_str}
        )
        return MiniSettings(
            nics=s.check_nics(nics),
            ssh_identity_file=ssh_identity_file,
            timeout_s=s.check_seconds("timeout_s", timeout_s),
            placement_group_timeout_s=s.check_seconds("placement_group_timeout_s", placement_group_timeout_s),
        )

    def __init__(
        self,
        settings: Any,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: int | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[float, float] | None = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
    ) -> None:
        self.settings = settings
        self.elastic = min_workers is not None
        self.plan: _StaticPlan | _ElasticPlan
        self.resources = s.worker_resources("RayExecutor", cpus_per_worker, use_gpu, gpus_per_worker, "gpus_per_worker")
        self.use_current_placement_group = use_current_placement_group
        if max_workers is not None and not min_workers:
            raise ValueError("max_workers was given without a positive min_workers: elastic runs need min_workers")
        if self.elastic:
            if num_workers is not None:
                raise ValueError("both min_workers and num_workers were given: a run is either elastic or static")
            ignored = {"num_hosts": num_hosts, "num_workers_per_host": num_workers_per_host != 1 or None}
            _warn_moot("elastic mode (min_workers=...) sets the world size itself", ignored)
            self.plan = _elastic_plan(
                settings, min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout, override_discovery
            )
        else:
            elastic_only = {
                "reset_limit": reset_limit,
                "cooldown_range": cooldown_range,
                "elastic_timeout": elastic_timeout if elastic_timeout != 600 else None,
                "override_discovery": not override_discovery or None,
            }
            _warn_moot("a static run (num_workers=...) is not elastic: pass min_workers for elastic mode", elastic_only)
            self.plan = _static_plan(num_workers, num_hosts, num_workers_per_host)
        self._check_settings()
        settings.elastic = self.elastic
        self._session: StaticSession | None = None
        self._started: tuple[dict[str, str], tuple[Any, list[Any], dict[str, Any]]] | None = None

    def _check_settings(self) -> None:
        for name in ("timeout_s", "placement_group_timeout_s", "verbose", "nics"):
            if not hasattr(self.settings, name):
                raise ValueError(f"settings has no {name!r}: make it with RayExecutor.create_settings()")
        s.check_nics(self.settings.nics)
        # fields a script may set on the settings after create_settings(), or a Horovod Settings object carries
        moot = {name: getattr(self.settings, name, None) for name in ("ssh_port", "ssh_identity_file", "key")}
        s.warn_no_counterpart("RayExecutor settings", moot)

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: list[Any] | None = None,
        executable_kwargs: dict[str, Any] | None = None,
        extra_env_vars: dict[str, Any] | None = None,
    ) -> None:
        """Static: start the workers, join them in one ring, build `executable_cls` in each (bounded by
        `placement_group_timeout_s + timeout_s`; `TimeoutError` if the cluster cannot place them).
        Elastic: keep the executable and environment for each `run()`."""
        if executable_cls is not None and not callable(executable_cls):
            raise ValueError(f"executable_cls must be a class, got {executable_cls!r}")
        if executable_args is not None and not isinstance(executable_args, (list, tuple)):
            raise ValueError(f"executable_args must be a list, got {executable_args!r}")
        if executable_kwargs is not None and not isinstance(executable_kwargs, dict):
            raise ValueError(f"executable_kwargs must be a dict, got {executable_kwargs!r}")
        if self._session is not None or self._started is not None:
            raise RuntimeError("start() was already called: call shutdown() first")
        env = {**s.check_env("extra_env_vars", extra_env_vars), **s.gloo_env(self.settings.nics)}
        executable = (executable_cls, list(executable_args or []), dict(executable_kwargs or {}))
        ensure_ray()
        self._warn_placement_group()
        plan = self.plan
        if isinstance(plan, _ElasticPlan):
            self._started = (env, executable)
            return
        timeout = self.settings.placement_group_timeout_s + self.settings.timeout_s
        discovery = _ExactlyPerHost(plan.per_host, self.resources) if plan.per_host else None
        trainer_kwargs = {
            **from_horovod(self.settings),
            "resources_per_worker": self.resources,
            "discovery": discovery,
            "elastic_timeout": timeout,
            "verbose": int(bool(self.settings.verbose)),
        }
        self._session = StaticSession(plan.num_workers, env, executable, trainer_kwargs)
        try:
            self._session.wait_started(timeout)
        except TimeoutError as e:
            if not plan.per_host:
                raise
            raise TimeoutError(
                f"{e}; num_hosts={plan.num_workers // plan.per_host} with "
                f"num_workers_per_host={plan.per_host} needs that many nodes each holding "
                f"{plan.per_host} workers of {self.resources}, free"
            ) from e

    def run(
        self,
        fn: Callable[..., Any],
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        callbacks: list[Callable[[Any], Any]] | None = None,
    ) -> list[Any]:
        """`fn(*args, **kwargs)` on every worker; every worker's value, in rank order.

        `callbacks` receive each dict rank 0 reports (`ray_logger.log`) during the call.
        """
        _check_fn(fn)
        return self._call(call_with(fn, list(args or []), dict(kwargs or {})), None, callbacks)

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable[[Any], Any]] | None = None) -> list[Any]:
        """`fn(executable)` on every worker; every worker's value, in rank order."""
        _check_fn(fn)
        return self._call(fn, None, callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(executable)` on rank 0 only (static mode); its value."""
        _check_fn(fn)
        if self.elastic:
            raise NotImplementedError("elastic mode has no execute_single (as in horovod.ray): use execute()")
        return self._call(fn, frozenset({0}), None)[0]

    def run_remote(
        self, fn: Callable[..., Any], args: list[Any] | None = None, kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """`fn(*args, **kwargs)` on every worker (static mode) without waiting: ObjectRefs in rank order."""
        _check_fn(fn)
        if self.elastic:
            raise NotImplementedError(
                "elastic mode has no run_remote (as in horovod.ray): its workers are ephemeral; use run()"
            )
        return self._live_session().submit(call_with(fn, list(args or []), dict(kwargs or {})))

    def shutdown(self) -> None:
        """Static: the workers leave and every actor and placement group of the run goes. A second call does nothing."""
        session, self._session, self._started = self._session, None, None
        if session is not None:
            session.stop()

    def _call(self, fn: Callable[[Any], Any], ranks: frozenset[int] | None, callbacks: Any) -> list[Any]:
        plan = self.plan
        if isinstance(plan, _StaticPlan):
            return self._live_session().call(fn, ranks, callbacks)
        if self._started is None:
            raise RuntimeError("call start() before run() or execute()")
        env, executable = self._started
        return run_elastic(fn, env, executable, callbacks, self._elastic_trainer_kwargs(plan))

    def _elastic_trainer_kwargs(self, plan: _ElasticPlan) -> dict[str, Any]:
        max_workers = plan.max_workers
        if max_workers is None:  # "unbounded": what the cluster holds now (the autoscaler is asked for no more)
            max_workers = max(plan.min_workers, sum(RayClusterDiscovery(self.resources)().values()))
            logger.info("max_workers=None: at most %d workers, the slots the cluster holds", max_workers)
        return {
            **from_horovod(self.settings),
            "min_workers": plan.min_workers,
            "max_workers": max_workers,
            "resources_per_worker": self.resources,
            "discovery": plan.discovery(self.settings),
            "elastic_timeout": plan.elastic_timeout,
            "reset_limit": plan.reset_limit,
            "cooldown_range": plan.cooldown_range,
            "verbose": int(bool(self.settings.verbose)),
        }

    def _live_session(self) -> StaticSession:
        if self._session is None:
            raise RuntimeError("call start() before run(), execute(), execute_single() or run_remote()")
        return self._session

    def _warn_placement_group(self) -> None:
        from ray.util.placement_group import get_current_placement_group

        if self.use_current_placement_group and get_current_placement_group() is not None:
            warnings.warn(
                "use_current_placement_group=True: ray-elastic places each worker in a placement group of its own, "
                "not in the caller's; the caller's bundles stay unused",
                s.HorovodRayWarning,
                3,
            )


@dataclass(frozen=True)
class _StaticPlan:
    num_workers: int
    per_host: int | None  # at most this many workers on one node (num_hosts mode)


@dataclass(frozen=True)
class _ElasticPlan:
    min_workers: int
    max_workers: int | None
    reset_limit: int | None
    cooldown_range: tuple[float, float]
    elastic_timeout: float
    override_discovery: bool

    def discovery(self, settings: Any) -> Any:
        """None (the Ray cluster) when overriding; else `settings.discovery`, as the trainer takes it."""
        return None if self.override_discovery else trainer_discovery(getattr(settings, "discovery", None))


def _static_plan(num_workers: Any, num_hosts: Any, num_workers_per_host: Any) -> _StaticPlan:
    if num_workers is not None and num_hosts is not None:
        raise ValueError("pass num_workers or num_hosts (with num_workers_per_host), not both")
    if num_workers is not None:
        return _StaticPlan(s.check_count("num_workers", num_workers), None)
    if num_hosts is None:
        raise ValueError("pass num_workers (static), num_hosts and num_workers_per_host (static), or min_workers")
    per_host = s.check_count("num_workers_per_host", num_workers_per_host)
    return _StaticPlan(s.check_count("num_hosts", num_hosts) * per_host, per_host)


def _elastic_plan(
    settings: Any,
    min_workers: Any,
    max_workers: Any,
    reset_limit: Any,
    cooldown_range: Any,
    elastic_timeout: Any,
    override_discovery: bool,
) -> _ElasticPlan:
    s.check_count("min_workers", min_workers)
    if max_workers is not None and s.check_count("max_workers", max_workers) < min_workers:
        raise ValueError(f"max_workers ({max_workers}) must be >= min_workers ({min_workers})")
    if reset_limit is not None:
        s.check_count("reset_limit", reset_limit, 0)
    cooldown = DEFAULT_COOLDOWN if cooldown_range is None else tuple(cooldown_range)
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in cooldown)
    if len(cooldown) != 2 or not numbers or cooldown[0] > cooldown[1]:
        raise ValueError(f"cooldown_range must be (min_s, max_s) with 0 <= min_s <= max_s, got {cooldown_range!r}")
    plan = _ElasticPlan(
        min_workers,
        max_workers,
        reset_limit,
        (float(cooldown[0]), float(cooldown[1])),
        s.check_seconds("elastic_timeout", elastic_timeout),
        bool(override_discovery),
    )
    plan.discovery(settings)  # a missing or unusable discovery fails here, before anything starts
    return plan


def trainer_discovery(discovery: Any) -> Any:
    """A Horovod `HostDiscovery` (its `find_available_hosts_and_slots`), a callable, or a script path."""
    if discovery is None:
        raise ValueError(
            "override_discovery=False needs settings.discovery (e.g. TestDiscovery(...) or a HostDiscovery)"
        )
    find = getattr(discovery, "find_available_hosts_and_slots", None)
    if callable(find):
        return find
    if callable(discovery) or isinstance(discovery, (str, os.PathLike)):
        return discovery
    raise ValueError(
        f"settings.discovery must have find_available_hosts_and_slots(), be a callable returning {{host: slots}} "
        f"or a script path, got {discovery!r}"
    )


@dataclass(frozen=True)
class _ExactlyPerHost:
    """The Ray cluster's nodes that hold `per_host` workers, each offering exactly `per_host` slots.

    With `num_hosts * num_workers_per_host` workers and hosts filled oldest
    first, every node used gets exactly `per_host` of them, as horovod.ray's
    one STRICT_SPREAD bundle per host does; a node that holds fewer is left
    out rather than given a partial share.
    """

    per_host: int
    per_worker: dict[str, float]

    def __call__(self) -> dict[str, int]:
        hosts = RayClusterDiscovery(self.per_worker)()
        return {host: self.per_host for host, slots in hosts.items() if slots >= self.per_host}


def _warn_moot(why: str, given: dict[str, Any]) -> None:
    named = [name for name, value in given.items() if value is not None]
    if named:
        warnings.warn(f"RayExecutor: {', '.join(named)} ignored: {why}", s.HorovodRayWarning, 3)


def _check_fn(fn: Any) -> None:
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")


def ensure_ray() -> None:
    """horovod.ray wants `ray.init()` called first; like `ElasticTrainer.fit()`, start or join one if not."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING)
