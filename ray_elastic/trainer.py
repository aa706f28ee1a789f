"""`ElasticTrainer` and `Result`: what the user calls, and what comes back.

`fit()` validates every argument before anything is spawned, starts a local
Ray if none is running, creates the run's KV actor and driver actor in a
namespace of their own, shows progress while the driver runs, and always
cleans up: no actor and no placement group of the run survives `fit()`,
whether it succeeded, failed or was interrupted.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import threading
import types
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.auth import RunToken
from ray_elastic.checkpoint import CheckpointError, CheckpointStore, within
from ray_elastic.config import RunConfig
from ray_elastic.data import check_datasets
from ray_elastic.data.feed import create_feed_actor
from ray_elastic.discovery import alive_ray_nodes, check_discovery_spec, keep_cpus_free, slots_for_resources
from ray_elastic.driver_actor import create_driver_actor
from ray_elastic.events import Event
from ray_elastic.exceptions import TrainingFailedError
from ray_elastic.following import Reports, cleanup, coordinator_node, follow
from ray_elastic.leftovers import run_namespace
from ray_elastic.payload import pack
from ray_elastic.protocol import RunOutcome
from ray_elastic.rendezvous import create_kv_actor

logger = logging.getLogger(__name__)

_INIT_LOCK = threading.Lock()


@dataclass
class Result:
    """What `fit()` returns.

    - `return_value`: what rank 0's `train_fn` returned.
    - `metrics`: the dicts rank 0 passed to `report()`, in order.
    - `metric_times`: when each was reported (seconds since the epoch).
    - `events`: membership events (`Event`: time, kind, world size, reset duration).
    - `resets`: how many times the ring was re-formed.
    - `run_id`: the run's id, the `run_id` tag of its Ray metrics.
    - `metrics_dropped`: reports not kept (older than the newest
      `keep_metrics`); `metrics` holds the newest ones.
    - `checkpoint_error`: None, or why the last durable checkpoint (to
      `checkpoint_dir`) could not be written after its retries; training
      finished and `return_value` is rank 0's, but a later run resumes from
      an older checkpoint.
    - `checkpoint_path`: where the run's last durable checkpoint is (a
      local directory or an fsspec URL), or None; `checkpoint` opens it.
    """

    return_value: Any
    metrics: list[dict[str, Any]] = field(default_factory=list)
    metric_times: list[float] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    resets: int = 0
    run_id: str = ""
    metrics_dropped: int = 0
    checkpoint_error: str | None = None
    checkpoint_path: str | None = None

    @property
    def checkpoint(self) -> Any:
        """The last durable checkpoint as a `ray.train.Checkpoint` (a directory of plain files), or None.

        `elastic.load_checkpoint(result.checkpoint)` gives its contents;
        plain `torch.load` reads its `.pt` files. Needs `ray[train]` or
        `ray[tune]` (the `tune` extra).
        """
        from ray_elastic.checkpoint.opening import ray_checkpoint

        return None if self.checkpoint_path is None else ray_checkpoint(self.checkpoint_path)

    def plot_timeline(self, path: str | os.PathLike) -> Path:
        """Save a PNG of world size and steps/s over time with the events marked; returns its path."""
        from ray_elastic.timeline import plot_timeline

        return plot_timeline(self.events, self.metric_times, path)


class ElasticTrainer:
    """Elastic data-parallel training of `train_fn(config)` on Ray actors.

    Args:
        train_fn: runs once in every worker actor; usually builds a model and
            a `State` and calls a function decorated with `@elastic.run`.
        min_workers: the run waits (up to `elastic_timeout`) until this many
            workers are ready, and pauses if fewer remain.
        max_workers: the world never grows beyond this.
        config: passed to `train_fn`; must be picklable.
        resources_per_worker: one worker's Ray resources (default `{"CPU": 1}`);
            each worker gets a placement group with one such bundle.
        discovery: None for the Ray cluster's alive nodes; a callable returning
            `{host: slots}`; or the path of an executable printing `host:slots`
            lines. Hosts are Ray node IDs (a unique IP is accepted).
        backend: "auto" (NCCL for GPU workers, else torch Gloo if torch is
            installed, else pygloo), "gloo", "pygloo" or "nccl" (GPU workers:
            `resources_per_worker` must ask for a GPU).
        elastic_timeout: seconds to wait for `min_workers` (at start and after
            losing workers), for a newcomer to boot and for placement; and
            the longest `fit()` waits for a driver actor that answers nothing.
        reset_limit: fail after this many resets (None: unbounded).
        cooldown_range: (min, max) seconds a host whose worker failed is held
            back, doubling with each failure, then offered again.
        discovery_interval: seconds between discovery polls.
        discovery_timeout: seconds one discovery call (callable or script) may
            take; a script still running then is killed. The first failure
            fails the run; later ones are retried with a warning until
            `elastic_timeout` passes without a success.
        liveness_timeout: a worker that does not answer a ping within this
            many seconds and uses no CPU is killed and treated as failed; one
            busy in a long C call that holds the GIL is spared up to
            `collective_timeout`.
        collective_timeout: seconds one collective (or forming one ring) may take.
        max_failures: how many exceptions raised by `train_fn` to retry as a
            failure of that worker (for flaky hardware); 0 (default) fails the
            run at the first one, with its traceback.
        checkpoint_dir: a local directory or an fsspec URL for durable
            checkpoints (None: in-memory commits only). Rank 0 writes the
            committed state there every `checkpoint_every` commits, as plain
            files (`torch.save`d state dicts, JSON) in a directory of its own,
            complete before it counts; a `fit()` that finds a checkpoint there
            resumes from the latest, and a run that loses every worker at once
            resumes from it with fresh workers. `Result.checkpoint` is the last one.
        checkpoint_every: commits between two durable checkpoints (default 10).
        checkpoint_keep: how many of the newest checkpoints `checkpoint_dir`
            keeps (default 2: the latest, and the one before it while the
            latest is written); older ones are removed after each write.
        datasets: Ray Datasets by name (`{"train": ray.data.read_parquet(...)}`),
            streamed by the run's feed actor; inside `train_fn`,
            `elastic.get_dataset_shard(name)` is this rank's shard, trained
            exactly once per epoch through every reset when it is in the
            committed state (`docs/user-guide.md`). Needs
            `ray[data]` (the `data` extra).
        data_cpus: with `datasets=`, how many whole CPUs of the cluster the
            workers leave free for Ray Data's read and map tasks (default 1:
            what one task asks for by default; raise it for a pipeline whose
            tasks or actors ask for more). Workers holding every CPU starve
            the pipeline. 0 lets the workers take every CPU.
        data_starvation_timeout: seconds a rank may wait for a block that the
            pipeline does not produce while the cluster has no free CPU; then
            the run fails with a `DataStarvedError` naming `data_cpus`
            (default 60).
        evict_stragglers: let a worker go when it is persistently slower
            than the others (1.5x their median compute per step for ~15 s)
            and the run is predicted faster without it: it leaves
            gracefully (no step redone), its host cools down over
            `cooldown_range` and is offered again on probation (default
            True). False keeps it and only reports it (a warning and a
            `straggler_found` event). Never below `min_workers`.
        keep_metrics: how many of rank 0's newest reports `Result.metrics`
            keeps (default 100,000; None keeps all); older ones are counted
            in `Result.metrics_dropped`. The driver holds only the reports
            `fit()` has not fetched yet, so its memory stays bounded either way.
        verbose: 0 silences progress and event lines; 1 shows them.
    """

    def __init__(
        self,
        train_fn: Callable[[dict[str, Any]], Any],
        min_workers: int,
        max_workers: int,
        config: Mapping[str, Any] | None = None,
        resources_per_worker: Mapping[str, float] | None = None,
        discovery: Callable[[], Mapping[str, int]] | str | os.PathLike | None = None,
        backend: str = "auto",
        elastic_timeout: float = 600.0,
        reset_limit: int | None = None,
        cooldown_range: tuple[float, float] = (10.0, 300.0),
        discovery_interval: float = 1.0,
        discovery_timeout: float = 30.0,
        liveness_timeout: float = 5.0,
        collective_timeout: float = 300.0,
        max_failures: int = 0,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 10,
        checkpoint_keep: int = 2,
        keep_metrics: int | None = 100_000,
        datasets: Mapping[str, Any] | None = None,
        data_cpus: int = 1,
        data_starvation_timeout: float = 60.0,
        evict_stragglers: bool = True,
        verbose: int = 1,
    ) -> None:
        if not callable(train_fn):
            raise ValueError(f"train_fn must be callable, got {type(train_fn).__name__}")
        if inspect.iscoroutinefunction(train_fn) or inspect.isasyncgenfunction(train_fn):
            raise ValueError("train_fn must be a plain function: an async def runs nothing until awaited")
        if inspect.isgeneratorfunction(train_fn):
            raise ValueError("train_fn must be a plain function: a generator function runs nothing until iterated")
        if backend == "pygloo" and refers_to(train_fn, "prepare_model"):
            raise ValueError(
                "train_fn calls prepare_model, which wraps the model in torch DistributedDataParallel and needs a "
                "torch.distributed process group; backend='pygloo' has none: pass backend='gloo' (CPU) or "
                "'nccl' (GPU), or leave backend='auto'"
            )
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict, got {type(config).__name__}")
        self.datasets = check_datasets(datasets)
        asked = dataset_names_asked(train_fn)
        if asked - set(self.datasets):
            given = f"datasets {sorted(self.datasets)}" if self.datasets else "no datasets="
            raise ValueError(
                f"train_fn asks get_dataset_shard for {sorted(asked - set(self.datasets))}, but ElasticTrainer "
                f"was given {given}"
            )
        self.run_config = RunConfig.create(
            min_workers=min_workers,
            max_workers=max_workers,
            resources_per_worker=resources_per_worker,
            backend=backend,
            elastic_timeout=elastic_timeout,
            reset_limit=reset_limit,
            cooldown_range=cooldown_range,
            discovery_interval=discovery_interval,
            discovery_timeout=discovery_timeout,
            liveness_timeout=liveness_timeout,
            collective_timeout=collective_timeout,
            max_failures=max_failures,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            checkpoint_keep=checkpoint_keep,
            keep_metrics=keep_metrics,
            datasets=tuple(self.datasets),
            data_cpus=data_cpus,
            data_starvation_timeout=data_starvation_timeout,
            evict_stragglers=evict_stragglers,
        )
        config = dict(config or {})
        try:
            self._payload = pack((train_fn, config))
        except Exception as e:
            raise ValueError(
                f"train_fn and config must be picklable to reach the workers: {type(e).__name__}: {e}"
            ) from e
        check_discovery_spec(discovery)
        if isinstance(discovery, (str, os.PathLike)):
            discovery = os.path.abspath(discovery)  # the driver actor's working directory may differ
        elif discovery is not None:
            try:
                discovery = pack(discovery)
            except Exception as e:
                raise ValueError(f"the discovery callable must be picklable: {type(e).__name__}: {e}") from e
        self.train_fn = train_fn
        self.config = config
        self.discovery = discovery
        self.verbose = verbose

    def as_trainable(self) -> Any:
        """This training as a Ray Tune trainable: each trial an elastic run (needs `ray[tune]`, the `tune` extra).

        `tune.Tuner(trainer.as_trainable(), param_space={...}, tune_config=...)`:
        `param_space` values are merged into `train_fn`'s config; every
        `report()` of rank 0 is the trial's result (include the metric Tune
        optimizes in each); a scheduler's stop ends the trial's workers,
        driver and KV actor; a worker lost inside a trial is recovered in
        place. A trial reserves `min_workers` workers through Tune's resource
        request and grows toward `max_workers` where the cluster has room
        beyond the other trials' reservations. With `checkpoint_dir`, each
        trial checkpoints into `<checkpoint_dir>/<experiment>/<trial id>`
        and hands every new checkpoint to Tune (`tune.get_checkpoint()`, the
        trial's `Result.checkpoint`; Tune's experiment resume). CPU workers
        only, without `discovery` or `datasets`: refused here otherwise.
        """
        from ray_elastic.tune import as_trainable

        return as_trainable(self)

    @property
    def backend(self) -> str:
        """The backend `backend="auto"` resolved to."""
        return self.run_config.backend

    def fit(self, on_report: Callable[[dict[str, Any]], None] | None = None) -> Result:
        """Train until rank 0's `train_fn` returns; raise `TrainingFailedError` otherwise.

        `on_report`: called with each dict rank 0 passed to `report()`, in
        order, in the thread running `fit()`, as `fit()` fetches them (about
        twice a second), the way a Tune trainable or a progress callback
        wants them. It is called once per report even when the driver
        restarts. An exception it raises stops the run (its workers are
        released) and propagates from `fit()`: a callback that cannot take a
        report must not be dropped silently.
        """
        if on_report is not None and not callable(on_report):
            raise ValueError(f"on_report must be callable, got {type(on_report).__name__}")
        with _INIT_LOCK:  # two threads' first fit() must not start two Ray instances
            if not ray.is_initialized():
                ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level=logging.WARNING)
        self._check_cluster_can_hold_a_worker()
        self._check_checkpoint_dir()
        data_line = _data_cpus_line(self.run_config) if self.datasets else None
        run_id = uuid.uuid4().hex[:12]
        namespace = run_namespace(run_id)
        kv = driver = None
        outcome: RunOutcome | None = None
        reports = Reports(self.run_config.keep_metrics, on_report)
        try:
            here = NodeAffinitySchedulingStrategy(coordinator_node(), soft=False)
            token = RunToken()  # the run's actors answer only calls carrying it (see auth.py)
            kv = create_kv_actor(run_id, namespace, token, here)
            # held until the run ends: Ray removes an actor, named or not, once no handle to it is left
            cfg = self.run_config
            feed = (
                create_feed_actor(namespace, token, self.datasets, here, cfg.data_cpus, cfg.data_starvation_timeout)
                if self.datasets
                else None
            )
            driver = create_driver_actor(run_id, namespace, token, self._payload, self.discovery, self.run_config, here)
            limit = self.run_config.elastic_timeout
            outcome = follow(driver, driver.run.remote(), reports, data_line, self.verbose, limit)
            del feed  # the run is over: its feed may go (the clean-up removes it in any case)
        finally:
            cleanup(driver, kv, run_id, namespace, graceful=outcome is not None)
        value = None if outcome.value is None else pickle.loads(outcome.value)
        if not outcome.ok:
            raise TrainingFailedError(outcome.error or "training failed", value)
        return Result(
            return_value=value,
            metrics=[m for _, m in reports.kept],
            metric_times=[t for t, _ in reports.kept],
            events=[Event(**e) for e in outcome.events],
            resets=outcome.resets,
            run_id=run_id,
            metrics_dropped=reports.dropped,
            checkpoint_error=outcome.checkpoint_error,
            checkpoint_path=_latest_checkpoint(self.run_config),
        )

    def _check_cluster_can_hold_a_worker(self) -> None:
        nodes = alive_ray_nodes()
        if self.run_config.resources_per_worker.get("GPU", 0) > 0 and not any(
            n.resources.get("GPU", 0) > 0 for n in nodes
        ):
            raise ValueError(
                f"backend={self.backend!r} with resources_per_worker={self.run_config.resources_per_worker} "
                "needs GPUs, but no node of the Ray cluster has one"
            )
        if not any(slots_for_resources(n.resources, self.run_config.resources_per_worker) for n in nodes):
            totals = [dict(n.resources) for n in nodes]
            raise ValueError(
                f"resources_per_worker={self.run_config.resources_per_worker} fits on no node of the Ray cluster "
                f"(node resources: {totals})"
            )

    def _check_checkpoint_dir(self) -> None:
        """Prove the checkpoint directory usable before anything starts, and say if the run resumes."""
        if self.run_config.checkpoint_dir is None:
            return
        store = CheckpointStore(self.run_config.checkpoint_dir)

        def probe() -> dict[str, Any] | None:
            store.check_writable()
            store.refuse_old_format()
            return store.meta()

        try:
            # storage that hangs (a dead mount) must not hang fit(): bounded as the driver's own look at it
            meta = within(self.run_config.discovery_timeout, f"checking {store.url!r} (discovery_timeout)", probe)
        except CheckpointError as e:
            raise ValueError(str(e)) from e
        if meta is not None and self.verbose:
            logger.warning(
                "resuming from the checkpoint in %s (commit %s, world size %s)",
                self.run_config.checkpoint_dir,
                meta.get("commit"),
                meta.get("world_size"),
            )


def _latest_checkpoint(cfg: RunConfig) -> str | None:
    """Where the run's latest durable checkpoint is (a path or URL), or None; storage errors only warn."""
    if cfg.checkpoint_dir is None:
        return None
    store = CheckpointStore(cfg.checkpoint_dir)
    try:
        latest = within(cfg.discovery_timeout, f"listing {store.url!r} (discovery_timeout)", store.latest)
    except Exception as e:  # noqa: BLE001 - training succeeded: a listing that fails must not lose its result
        logger.warning("cannot find the latest checkpoint in %s: %s", store.url, e)
        return None
    return None if latest is None else store.url_of(latest)


def _data_cpus_line(cfg: RunConfig) -> str:
    """What a run with datasets keeps for its data pipeline, and why: the line `fit()` shows before training."""
    if cfg.kept_cpus == 0:
        return (
            "[ray-elastic] data_cpus=0: the workers may take every CPU of the cluster; a dataset that then "
            f"produces nothing for {cfg.data_starvation_timeout:g} s fails the run"
        )
    nodes = alive_ray_nodes()
    per_worker = cfg.resources_per_worker
    slots = {n.node_id: slots_for_resources(n.resources, per_worker) for n in nodes}
    kept = sum(keep_cpus_free(slots, nodes, per_worker.get("CPU", 0.0), cfg.kept_cpus).values())
    line = (
        f"[ray-elastic] keeping {cfg.kept_cpus} CPU(s) of the cluster free for Ray Data's read and map tasks "
        f"(data_cpus={cfg.kept_cpus}; workers holding every CPU would starve the dataset): "
        f"{kept} worker slot(s) of the {sum(slots.values())} the cluster holds"
    )
    if kept < cfg.min_workers:
        line += f"; fewer than min_workers={cfg.min_workers}: the run waits up to elastic_timeout for more nodes"
    return line


def _plain_function(fn: Callable[..., Any]) -> types.FunctionType | None:
    """The Python function behind `fn` (through functools.partial, decorators, a callable object), if any."""
    fn = inspect.unwrap(getattr(fn, "func", fn))
    if not isinstance(fn, types.FunctionType):
        fn = inspect.getattr_static(type(fn), "__call__", None)
    return fn if isinstance(fn, types.FunctionType) else None


def dataset_names_asked(fn: Callable[..., Any]) -> set[str]:
    """The names `fn` passes to `get_dataset_shard` as a literal first argument (its own code and nested code).

    Lets the trainer refuse an unknown name before any worker starts; a name
    computed at run time is left to `get_dataset_shard`'s own error.
    """
    import dis

    fn = _plain_function(fn)
    if fn is None:
        return set()
    names: set[str] = set()
    todo, seen = [fn.__code__], set()
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        ops = [i for i in dis.get_instructions(code) if i.opname not in ("PUSH_NULL", "CACHE", "PRECALL")]
        for this, after in zip(ops, ops[1:], strict=False):
            if this.argval == "get_dataset_shard" and this.opname.startswith("LOAD_") and after.opname == "LOAD_CONST":
                if isinstance(after.argval, str):
                    names.add(after.argval)
    return names


def refers_to(fn: Callable[..., Any], name: str, depth: int = 3) -> bool:
    """Whether `fn`'s code, or that of a function of its own module it calls, refers to `name`.

    Reads the names in the bytecode (nested functions included; a global and
    an attribute alike, so `elastic.torch.prepare_model` counts), following
    module-level functions of `fn`'s module up to `depth` calls deep. Lets
    the trainer refuse a combination before any worker starts; a reference it
    cannot see (through another module) is left to the worker's own check.
    """
    fn = _plain_function(fn)
    if fn is None:
        return False
    seen: set[types.CodeType] = set()
    todo = [(fn.__code__, 0)]
    while todo:
        code, level = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        if name in code.co_names:
            return True
        todo += [(c, level) for c in code.co_consts if isinstance(c, types.CodeType)]
        if level < depth:
            for called in code.co_names:
                callee = fn.__globals__.get(called)
                if isinstance(callee, types.FunctionType) and callee.__module__ == fn.__module__:
                    todo.append((callee.__code__, level + 1))
    return False
