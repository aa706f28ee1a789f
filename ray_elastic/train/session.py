"""The worker side of `ray_elastic.train`: Ray Train's per-worker calls on an elastic run, and the re-entry loop.

`PerWorker` is the `train_fn` the elastic driver runs in every worker. It
calls the user's `train_loop_per_worker` inside `@elastic.run` over one
`ObjectState` holding what a Ray Train loop resumes from: the last reported
checkpoint's files, in memory, and the committed positions of the loop's
prepared loaders and dataset shards.

- `report(metrics, checkpoint=c)` is the commit point. Every rank calls it at
  the same step (as Ray Train requires); one tiny allreduce tells whether any
  rank passed a checkpoint. If one did, every rank's files are combined into
  one checkpoint (`report_files.py`: one rank's, as DDP scripts pass, is kept
  whole by every rank; several ranks' files, as FSDP2's `dcp.save` writes,
  are kept by each owner and one replica holder on another node), written
  durably under `Result.path` (`report_store.py`), the data positions are
  taken, and the state is committed, which is where membership changes are
  agreed. A report without a checkpoint on every rank commits nothing.
- A failure (a dead peer) or a membership change unwinds the loop; the state
  rolls back to the last report with a checkpoint (or keeps it, on a graceful
  change), the ring is rebuilt, and `train_loop_per_worker` is called again
  in the same process. At that entry every rank gathers all of the last
  report's files from their live holders (owner or replica), so
  `get_checkpoint()` returns every rank's files and `dcp.load` reshards them
  to the new world. Newcomers get the same state by the sync and the gather. Before each call the previous
  call's leftovers (its frames, loader iterators, cached GPU memory) are freed.
- The interrupts cross the user's code as `LoopInterrupt`, a `BaseException`,
  so an `except Exception` in the loop cannot swallow them.
- For the call's duration, `ray.train.report`/`get_checkpoint`/`get_context`/
  `get_dataset_shard` and `ray.train.torch.prepare_model`/`prepare_data_loader`/
  `get_device` are these, so fully qualified calls reach them too.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import inspect
import logging
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from ray.train import Checkpoint

import ray_elastic as elastic
import ray_elastic.torch as elastic_torch
from ray_elastic.runtime import current, maybe_current
from ray_elastic.train.report_store import ReportStore, write_files

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from ray_elastic.train.report_files import Files, Layout

logger = logging.getLogger(__name__)


class LoopInterrupt(BaseException):  # noqa: N818 - named for what it does to the loop, as Horovod's interrupts are
    """A failure or a membership change unwinding `train_loop_per_worker` (not an `Exception`: it is not the loop's)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the elastic run is resetting: {type(cause).__name__}: {cause}")
        self.cause = cause


class TrainContext:
    """What `get_context()` returns: Ray Train's `TrainContext` getters on the current generation."""

    def __init__(self, experiment_name: str) -> None:
        self._experiment_name = experiment_name

    def get_world_rank(self) -> int:
        return elastic.rank()

    def get_world_size(self) -> int:
        return elastic.size()

    def get_local_rank(self) -> int:
        return elastic.local_rank()

    def get_local_world_size(self) -> int:
        return elastic.local_size()

    def get_node_rank(self) -> int:
        """This worker's host among the run's hosts (`ray_elastic.cross_rank()`)."""
        return elastic.cross_rank()

    def get_experiment_name(self) -> str:
        return self._experiment_name


class Session:
    """One worker's Ray Train loop: the committed state, and what the current call prepared.

    Args:
        experiment_name: `RunConfig.name`, for `get_context()`.
        initial: `resume_from_checkpoint`'s files, or None.
        run_path: `Result.path`, where each report's checkpoint is written
            durably (None: nowhere).
        num_to_keep: how many durable checkpoints stay (`CheckpointConfig`;
            None: all).
    """

    def __init__(
        self,
        experiment_name: str,
        initial: Files | None,
        run_path: str | None = None,
        num_to_keep: int | None = None,
    ) -> None:
        self.context = TrainContext(experiment_name)
        self.store = ReportStore(run_path)
        self.num_to_keep = num_to_keep
        layout = None if initial is None else self.store.hold_whole(0, initial)
        # checkpoint: the last report's `Layout` (its files are in `store`), or None; durable: [directory name,
        # rank's metrics] of the durable checkpoints kept; loaders: sampler states by call order
        self.state: Any = elastic.ObjectState(checkpoint=layout, durable=[], loaders=[], shards={})
        self.loaders: list[Any] = []  # this call's prepared loaders, in the order it prepared them
        self.shard_names: set[str] = set()
        self._materialized: tuple[int, str] | None = None  # the checkpoint written out for get_checkpoint()
        # wall-clock times (time.time()) of this call's re-entry: "left" (the previous call unwound out of the
        # loop), "called" (rejoined and synced), "collected", "settled"; logged, and read by bench/ray_train_recovery.py
        self.marks: dict[str, float] = {}

    # ---- the re-entry ----------------------------------------------------------------
    def warm_up(self) -> None:
        """Before the worker first joins (a join preparation): import what building a DDP imports on first use.

        torch's `DistributedDataParallel` imports `torch._dynamo` the first time
        one is built: some 50,000 objects, which every re-entry's full collect
        would walk again. Imported here, they are in the boot's collection and
        `gc.freeze()` (`Membership.run_join_preparations`), and a newcomer
        imports them while the survivors train, not in its first call.
        """
        importlib.import_module("torch._dynamo")

    def begin_call(self) -> None:
        """Free what the previous call held (frames, loader iterators, cached GPU memory) before the next."""
        self.marks["called"] = time.time()
        self.loaders = []
        self.shard_names = set()
        # what the interrupted call left in reference cycles: a DDP, loader iterators, their tensors. A full
        # collect, which walks only what was made since the boot's gc.freeze() (Membership.run_join_preparations)
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        self.marks["collected"] = time.time()

    def settle(self) -> None:
        """At an entry into the loop (every rank): gather the committed report's files where any rank lacks them."""
        layout = self.state.checkpoint
        if layout is None:  # every rank synced the same state, so every rank skips the collective alike
            self.store.keep_only(None)
        else:
            generation = current().joined()
            everything = self.store.settle(generation.ring, layout, generation.slot.host)
            if everything is not None:
                self._materialize(layout["index"], everything)
        marks = self.marks
        marks["settled"] = time.time()
        if "left" in marks:
            logger.info(
                "rank %d re-entering the loop: rejoined and synced in %.3f s, collected in %.3f s, settled in %.3f s",
                elastic.rank(),
                marks["called"] - marks["left"],
                marks["collected"] - marks["called"],
                marks["settled"] - marks["collected"],
            )

    def close(self) -> None:
        if self._materialized is not None:
            shutil.rmtree(self._materialized[1], ignore_errors=True)
            self._materialized = None

    # ---- report and get_checkpoint -------------------------------------------------------
    def report(
        self, metrics: dict[str, Any], checkpoint: Checkpoint | None, delete_local: bool, directory: str | None = None
    ) -> None:
        with _interrupts_unwind():
            _check_ring()
            elastic.report(metrics)
            me, size = elastic.rank(), elastic.size()
            holder = int(elastic.allreduce(np.array([me if checkpoint is not None else size]), op=elastic.Min)[0])
            if holder == size:
                return  # no rank passed a checkpoint: no commit, no membership change
            files = _read_files(checkpoint) if checkpoint is not None else None
            if delete_local and checkpoint is not None:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
            held: Layout | None = self.state.checkpoint
            index = 1 if held is None else held["index"] + 1
            name = directory or f"checkpoint_{index:06d}"
            generation = current().joined()
            ring, host = generation.ring, generation.slot.host
            layout = self.store.report(ring, files, index, host, name, generation.number)
            durable = [entry for entry in self.state.durable if entry[0] != name]
            if layout["directory"] is not None:
                durable.append([name, dict(metrics)])
            keep = len(durable) if self.num_to_keep is None else self.num_to_keep
            dropped = [entry[0] for entry in durable[: len(durable) - keep]]
            self.state.checkpoint, self.state.durable = layout, durable[len(durable) - keep :]
            for loader in self.loaders:
                loader.sampler.record_pending()  # the batch trained before this report counts
            self.state.loaders = [loader.sampler.state_dict() for loader in self.loaders]
            self.state.commit()
            self.store.committed(ring, index, dropped)

    def get_checkpoint(self) -> Checkpoint | None:
        layout: Layout | None = self.state.checkpoint
        if layout is None:
            return None
        index = layout["index"]
        if self._materialized is None or self._materialized[0] != index:
            files = self.store.local_files(layout)
            if files is None:  # a report of several parts, asked for before any reset: its durable copy is whole
                run_path, name = self.store.run_path, layout["directory"]
                if run_path is None or name is None:
                    raise elastic.CheckpointError(f"checkpoint {index}'s files are spread over the ranks, none durable")
                return Checkpoint.from_directory(os.path.join(run_path, name))
            self._materialize(index, files)
        assert self._materialized is not None
        return Checkpoint.from_directory(self._materialized[1])

    def _materialize(self, index: int, files: Files) -> None:
        self.close()
        directory = tempfile.mkdtemp(prefix=f"ray_elastic_checkpoint_{index:06d}_")
        write_files(files, directory)
        self._materialized = (index, directory)

    # ---- data --------------------------------------------------------------------------
    def prepare_data_loader(self, data_loader: Any, move_to_device: bool) -> Any:
        with _interrupts_unwind():
            loader = elastic_torch.prepare_data_loader(data_loader, move_to_device=move_to_device)
        committed = self.state.loaders
        k = len(self.loaders)
        if k < len(committed) and committed[k]["n"] == len(loader.dataset):
            loader.sampler.load_state_dict(committed[k])  # where the last report left this loader
        self.loaders.append(loader)
        return loader

    def get_dataset_shard(self, name: str) -> Any:
        with _interrupts_unwind():
            shard = elastic.get_dataset_shard(name)
        held = self.state.shards.get(name)
        if held is None:
            fresh = {"epoch": 0, "position": 0, "padding_rows": 0, "dropped_rows": 0}
            shard.load_state_dict({**shard.state_dict(), **fresh})  # nothing committed yet: the first epoch
            self.state.shards = {**self.state.shards, name: shard}
        elif held is not shard:
            shard.load_state_dict(held.state_dict())  # a newcomer's synced position
            self.state.shards = {**self.state.shards, name: shard}
        self.shard_names.add(name)
        return ShardIterator(shard)


class ShardIterator:
    """A dataset shard as Ray Train's `DataIterator`: each `iter_*` call is one pass (an epoch) of the dataset.

    A pass the loop ran to its end moves the shard to its next epoch; a pass
    cut by a reset resumes from the position the last report committed.
    """

    def __init__(self, shard: Any) -> None:
        self._shard = shard

    def iter_batches(self, **options: Any) -> Iterator[Any]:
        """As Ray's `DataIterator.iter_batches`: its keywords and defaults (`DataShard.iter_batches` says which
        it refuses by name, and why)."""
        return self._pass(self._shard.iter_batches(**options))

    def iter_torch_batches(self, **options: Any) -> Iterator[Any]:
        """As Ray's `DataIterator.iter_torch_batches`: tensors on the worker's device (`device="auto"`), or
        `collate_fn`'s batches."""
        return self._pass(self._shard.iter_torch_batches(**options))

    def _pass(self, batches: Iterator[Any]) -> Iterator[Any]:
        yield from batches
        self._shard.set_epoch(self._shard.epoch + 1)  # the loop came back after the last batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_shard"], name)


# ---- the module-level calls, as Ray Train names them -------------------------------------

_SESSION: Session | None = None  # the loop running in this worker process, while it runs


def current_session(what: str) -> Session:
    if _SESSION is None:
        raise RuntimeError(
            f"ray_elastic.train.{what}() only works inside train_loop_per_worker run by ray_elastic.train.torch."
            "TorchTrainer.fit()"
        )
    return _SESSION


def _check_ring() -> None:
    """Raise if the ring already broke: an error the loop swallowed must not let it train on a dead ring."""
    ctx = maybe_current()
    ring = getattr(ctx, "group", None) if ctx is not None else None
    if ring is not None and ring.abandoned is not None:
        raise elastic.HorovodInternalError(ring.abandoned)


@contextlib.contextmanager
def _interrupts_unwind() -> Iterator[None]:
    """Let a failure or membership change leave as `LoopInterrupt`, past the user's `except Exception`."""
    try:
        yield
    except (elastic.HorovodInternalError, elastic.HostsUpdatedInterrupt) as e:
        raise LoopInterrupt(e) from e
    except Exception as e:
        if current().ring_failure(e) is not None:
            raise LoopInterrupt(e) from e
        raise


def _read_files(checkpoint: Checkpoint) -> Files:
    if not isinstance(checkpoint, Checkpoint):
        raise TypeError(f"report(checkpoint=...) takes a ray.train.Checkpoint, got {type(checkpoint).__name__}")
    files: Files = {}
    with checkpoint.as_directory() as directory:
        for root, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    files[os.path.relpath(path, directory)] = f.read()
    return files


def read_directory(checkpoint: Checkpoint) -> Files:
    """A checkpoint's files, in memory (`TorchTrainer(resume_from_checkpoint=...)`)."""
    return _read_files(checkpoint)


# ---- the loop ------------------------------------------------------------------------------

_PATCHED = {
    "ray.train": ("report", "get_checkpoint", "get_context", "get_dataset_shard", "get_all_reported_checkpoints"),
    "ray.train.torch": ("prepare_model", "prepare_data_loader", "get_device", "get_devices"),
}


@contextlib.contextmanager
def _ray_train_calls_elastic() -> Iterator[None]:
    """`ray.train.report(...)` and the others reach this module's functions while the loop runs (this process only)."""
    ours = {"ray.train": "ray_elastic.train", "ray.train.torch": "ray_elastic.train.torch"}
    saved: list[tuple[Any, str, Any]] = []
    try:
        for module_name, names in _PATCHED.items():
            module, replacement = importlib.import_module(module_name), importlib.import_module(ours[module_name])
            for name in names:
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, getattr(replacement, name))
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


class PerWorker:
    """The `train_fn` an elastic run ships to its workers: the user's loop in the re-entry loop."""

    # what ElasticTrainer's checks before anything starts read: the user's loop (as a functools.partial's `func`),
    # and the names to use in their errors
    names_in_errors = ("train_loop_per_worker", "TorchTrainer")

    @property
    def func(self) -> Callable[..., Any]:
        return self.loop

    def __init__(
        self,
        loop: Callable[..., Any],
        config: dict[str, Any] | None,
        experiment_name: str,
        initial: Files | None,
        run_path: str | None = None,
        num_to_keep: int | None = None,
    ) -> None:
        self.loop = loop
        self.takes_config = len(inspect.signature(loop).parameters) > 0
        self.config = config
        self.experiment_name = experiment_name
        self.initial = initial
        self.run_path = run_path
        self.num_to_keep = num_to_keep

    def __call__(self, _config: dict[str, Any]) -> Any:
        global _SESSION
        this = Session(self.experiment_name, self.initial, self.run_path, self.num_to_keep)
        current().add_join_preparation(this.warm_up)

        @elastic.run
        def call(state: Any) -> Any:
            this.begin_call()
            this.settle()  # the last report's files, from their live holders, before the loop asks for them
            try:
                with _ray_train_calls_elastic():
                    value = (
                        self.loop(self.config if self.config is not None else {}) if self.takes_config else self.loop()
                    )
            except LoopInterrupt as interrupt:
                this.marks = {"left": time.time()}
                raise interrupt.cause from None  # the run loop rolls back (or keeps) and calls again
            except BaseException:
                this.marks = {"left": time.time()}
                raise
            return value, state.durable  # rank 0's: the durable checkpoints kept, with their metrics

        _SESSION = this
        try:
            return call(this.state)
        finally:
            _SESSION = None
            this.close()
