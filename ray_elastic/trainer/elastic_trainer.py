"""`ElasticTrainer` and `Result`: what the user calls, and what comes back.

`fit()` validates every argument before anything is spawned, starts a local
Ray if none is running, creates the run's KV actor and driver actor in a
namespace of their own, shows progress while the driver runs, and always
cleans up: no actor and no placement group of the run survives `fit()`,
whether it succeeded, failed or was interrupted.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import threading
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_elastic.auth import RunToken
from ray_elastic.checkpoint import CheckpointStore, bounded_call
from ray_elastic.config import RunConfig
from ray_elastic.data import check_datasets
from ray_elastic.data.feed import create_feed_actor
from ray_elastic.discovery import check_discovery_spec
from ray_elastic.driver_host import create_driver_actor
from ray_elastic.events import Event
from ray_elastic.exceptions import TrainingFailedError
from ray_elastic.options import BY_NAME
from ray_elastic.options import docs as option_docs
from ray_elastic.rendezvous import create_kv_actor
from ray_elastic.run_footprint import run_namespace
from ray_elastic.shipping import pack, unpack
from ray_elastic.trainer import preflight
from ray_elastic.trainer.driver_watch import Reports, cleanup, coordinator_node, follow

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from pathlib import Path

    from ray_elastic.protocol import RunOutcome

logger = logging.getLogger(__name__)

_INIT_LOCK = threading.Lock()


@dataclass
class Result:
    """What `fit()` returns.

    - `return_value`: what rank 0's `train_fn` returned.
    - `metrics`: rank 0's last `report()` (a dict, empty if it reported
      nothing), as Ray Train's `Result.metrics` is.
    - `metrics_history`: every dict rank 0 passed to `report()`, in order;
      `metrics_dataframe` the same as a pandas DataFrame (needs pandas).
    - `metric_times`: when each was reported (seconds since the epoch).
    - `events`: membership events (`Event`: time, kind, world size, reset duration).
    - `resets`: how many times the ring was re-formed.
    - `spares_promoted`: how many hot spares (`spares=`) took a place in a
      generation; each promotion is also a `spare_promoted` event.
    - `run_id`: the run's id, the `run_id` tag of its Ray metrics.
    - `metrics_dropped`: reports not kept (older than the newest
      `keep_metrics`); `metrics_history` holds the newest ones.
    - `checkpoint_error`: None, or why the last durable checkpoint (to
      `checkpoint_dir`) could not be written after its retries; training
      finished and `return_value` is rank 0's, but a later run resumes from
      an older checkpoint.
    - `checkpoint_path`: where the run's last durable checkpoint is (a
      local directory or an fsspec URL), or None; `checkpoint` opens it.
    """

    return_value: Any
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    metric_times: list[float] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    resets: int = 0
    spares_promoted: int = 0
    run_id: str = ""
    metrics_dropped: int = 0
    checkpoint_error: str | None = None
    checkpoint_path: str | None = None

    @property
    def metrics(self) -> dict[str, Any]:
        """Rank 0's last report (empty if it reported nothing): Ray Train's `Result.metrics`."""
        return self.metrics_history[-1] if self.metrics_history else {}

    @property
    def metrics_dataframe(self) -> Any:
        """Every report of rank 0 as a pandas DataFrame, one row each, with a `time` column (needs pandas)."""
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("Result.metrics_dataframe needs pandas (pip install pandas)") from e
        return pd.DataFrame(self.metrics_history).assign(time=self.metric_times)

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
        from ray_elastic.trainer.timeline import plot_timeline

        return plot_timeline(self.events, self.metric_times, path)


class ElasticTrainer:
    """Elastic data-parallel training of `train_fn(config)` on Ray actors.

    Args:
        train_fn: runs once in every worker actor; usually builds a model and
            a `State` and calls a function decorated with `@elastic.run`.
        config: passed to `train_fn`; must be picklable.
        discovery: None for the Ray cluster's alive nodes; a callable returning
            `{host: slots}`; or the path of an executable printing `host:slots`
            lines. A host is a Ray node ID, or an IP address or hostname
            that belongs to exactly one Ray node.
        datasets: Ray Datasets by name (the option `datasets` below).
        verbose: 0 silences progress and event lines; 1 shows them.

    The run's options, grouped by concern in `ray_elastic.options` (their one
    declaration: defaults, checks, command-line flags), follow.
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
        liveness_timeout: float = 2.0,
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
        *,
        checkpoint_timeout: float | None = None,
        spares: int = 0,
    ) -> None:
        options = {name: value for name, value in locals().items() if name in BY_NAME}  # the run's options
        preflight.check_train_fn(train_fn, backend)
        preflight.check_config(config)
        preflight.check_verbose(verbose)
        self.datasets = check_datasets(datasets)
        preflight.check_dataset_names(train_fn, self.datasets)
        self.run_config = RunConfig.create(**{**options, "datasets": tuple(self.datasets)})
        config = dict(config or {})
        try:
            self._payload = pack((train_fn, config))
        except Exception as e:
            raise ValueError(
                f"train_fn and config must be picklable to reach the workers: {type(e).__name__}: {e}"
            ) from e
        check_discovery_spec(discovery)
        shipped: str | bytes | None = None  # what the driver actor gets: a script's absolute path, or pickled
        if isinstance(discovery, (str, os.PathLike)):
            shipped = os.path.abspath(discovery)  # the driver actor's working directory may differ
        elif discovery is not None:
            try:
                shipped = pack(discovery)
            except Exception as e:
                raise ValueError(f"the discovery callable must be picklable: {type(e).__name__}: {e}") from e
        self.train_fn = train_fn
        self.config = config
        self.discovery = shipped
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

    def variant(
        self,
        *,
        config: Mapping[str, Any] | None = None,
        discovery: Any = None,
        reserved_cpus: float | None = None,
        **options: Any,
    ) -> ElasticTrainer:
        """A copy of this trainer for another run of the same `train_fn` (a Ray Tune trial is one).

        `config` is merged over `train_fn`'s config; `discovery` (a callable,
        pickled here) replaces this trainer's; `options` change the run's
        options, checked as the constructor checks them; `reserved_cpus`: the
        CPUs each worker's threads follow where its own request holds none.
        """
        other = copy.copy(self)
        if config is not None:
            # from the payload: a trainer shipped to Tune travels without its train_fn attribute
            train_fn, base = unpack(self._payload)
            other.train_fn, other.config = train_fn, {**base, **config}
            other._payload = pack((train_fn, other.config))
        if discovery is not None:
            other.discovery = pack(discovery)
        other.run_config = self.run_config.replace(reserved_cpus=reserved_cpus, **options)
        return other

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
        preflight.check_cluster_can_hold_a_worker(self.run_config)
        preflight.check_checkpoint_dir(self.run_config, self.verbose)
        data_line = preflight.data_cpus_line(self.run_config) if self.datasets else None
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
            metrics_history=[m for _, m in reports.kept],
            metric_times=[t for t, _ in reports.kept],
            events=[Event(**e) for e in outcome.events],
            resets=outcome.resets,
            spares_promoted=outcome.spares_promoted,
            run_id=run_id,
            metrics_dropped=reports.dropped,
            checkpoint_error=outcome.checkpoint_error,
            checkpoint_path=_latest_checkpoint(self.run_config),
        )


def _latest_checkpoint(cfg: RunConfig) -> str | None:
    """Where the run's latest durable checkpoint is (a path or URL), or None; storage errors only warn."""
    if cfg.checkpoint_dir is None:
        return None
    store = CheckpointStore(cfg.checkpoint_dir)
    try:
        latest = bounded_call(cfg.discovery_timeout, f"listing {store.url!r} (discovery_timeout)", store.latest)
    except Exception as e:  # noqa: BLE001 - training succeeded: a listing that fails must not lose its result
        logger.warning("cannot find the latest checkpoint in %s: %s", store.url, e)
        return None
    return None if latest is None else store.url_of(latest)


ElasticTrainer.__doc__ = (ElasticTrainer.__doc__ or "") + "\n" + option_docs() + "\n"
