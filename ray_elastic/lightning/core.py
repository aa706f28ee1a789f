"""The Lightning classes, built once per Lightning package (`lightning.pytorch` or `pytorch_lightning`).

Both packages ship the same classes under different module names, and a
Trainer accepts only its own package's `Strategy`, `ClusterEnvironment` and
`Callback`. So the classes here are made by `build(pl)` for the package the
user's Trainer comes from; `ray_elastic.lightning` exports the ones for
`lightning.pytorch` and `ray_elastic.lightning.pytorch_lightning` the others.

How a fit stays elastic (see `prepare_trainer`):

- `ElasticEnvironment` reports the current generation's rank and size, so
  `trainer.global_rank`, `is_global_zero` and `world_size` follow every reset.
- `ElasticDDPStrategy` never creates a process group (the elastic ring is
  torch's default group while the run loop holds it), wraps the module with
  `ray_elastic.torch.prepare_model` (a DDP rebuilt on each generation's
  ring), replaces the training loader's `DistributedSampler` with an
  `ElasticSampler`, and sends `barrier/broadcast/reduce/all_gather` over the
  current ring.
- Its callback commits every `commit_every` optimizer steps and checks for
  host changes on the others. A commit is Lightning's own checkpoint dict
  (model, optimizers, LR schedulers, precision plugin state such as the AMP
  scaler, the loops' progress, callbacks' state, and through the callback
  the sampler position and the world size the LR is scaled for), copied
  in memory by an `ObjectState`.
- Every (re-)entry into `fit` resumes from the last commit through
  Lightning's own checkpoint restore, which puts the loops back at the
  committed batch of the committed epoch.
"""

from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

import ray_elastic as elastic
from ray_elastic.torch import ElasticSampler, broadcast_parameters, prepare_model

if TYPE_CHECKING:
    from collections.abc import Iterator

logger = logging.getLogger(__name__)

# the ckpt_path under which the strategy hands Lightning the in-memory commit
COMMIT_PATH = "ray-elastic://last-commit"
# DDP keyword arguments the ring decides (prepare_model refuses them)
_RING_OPTIONS = ("process_group", "device_mesh", "init_sync")
# DDPStrategy's communication-hook options (post-local SGD among them), refused: see ElasticDDPStrategy.__init__
_COMM_HOOK_OPTIONS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
_OPS = {"mean": "average", "avg": "average", "sum": "sum", "max": "max", "min": "min"}


def _op_name(reduce_op: Any) -> str:
    """Lightning's reduce op ("mean", "sum", torch's ReduceOp) as the library's op name."""
    if reduce_op is None:
        return "average"
    name = getattr(reduce_op, "name", None) or str(reduce_op).split(".")[-1]
    name = name.lower()
    if name not in _OPS:
        raise ValueError(f"ElasticDDPStrategy.reduce supports mean, sum, max and min, got {reduce_op!r}")
    return _OPS[name]


def rescale_lr(optimizers: list[Any], schedulers: list[Any], factor: float) -> None:
    """Multiply every LR the optimizers and schedulers compute from by `factor` (docs/train-fn.md's recipe)."""
    if factor == 1:
        return
    for opt in optimizers:
        for group in opt.param_groups:
            for key in ("lr", "initial_lr", "max_lr", "min_lr"):
                if key in group and isinstance(group[key], (int, float)):
                    group[key] *= factor
    for sched in schedulers:
        if hasattr(sched, "base_lrs"):
            sched.base_lrs = [lr * factor for lr in sched.base_lrs]


class EpochLoader:
    """The training loader over an `ElasticSampler`, sized as the epoch Lightning resumes.

    Lightning counts a resumed epoch's batches from where the commit left it
    (`offset`) and ends the epoch when that count reaches the loader's
    length, so the length is `offset` plus the batches this rank still has.
    A batch counts as trained only when the loop says its step ended
    (`trained`, from the commit callback's `on_train_batch_end`): Lightning
    fetches one batch ahead, so a batch handed out is not yet trained.
    """

    def __init__(self, loader: DataLoader, sampler: ElasticSampler, offset: int) -> None:
        self.loader = loader
        self.sampler = sampler
        self.offset = offset

    def __len__(self) -> int:
        return self.offset + len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def trained(self, batch_idx: int) -> None:
        """Lightning's batch `batch_idx` of the epoch ended its step: its samples are trained."""
        self.sampler.record_batch(batch_idx - self.offset, self.loader.batch_size)

    def __getattr__(self, name: str) -> Any:
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)  # dataset, batch_size, num_workers ...


def resumed_batches(epoch_loop: Any) -> int:
    """The batch number Lightning resumes a restored epoch at: the batches the commit counts as done.

    A commit is taken in `on_train_batch_end`, before Lightning counts that
    batch completed. Lightning versions that know they restarted there
    (`restarted_on_train_batch_end`) count it when the epoch loop resets,
    after the loader is built, and go on with the next batch; older ones run
    it again. The sampler counted it trained either way, so the loader's
    length must start from the same number Lightning will, or the epoch's
    last batch is never fetched (and the first one after the resume is
    recorded as a batch further on).
    """
    completed = epoch_loop.batch_progress.current.completed
    if not hasattr(type(epoch_loop), "restarted_on_train_batch_end"):
        return completed  # a Lightning that runs the batch again
    # the condition Lightning's loop reset reads (it has not run yet: the loader is built first)
    total = epoch_loop.batch_progress.total
    ended_its_step = total.ready == total.started == total.processed == total.completed + 1
    return completed + 1 if ended_its_step else completed


def build(pl: Any) -> SimpleNamespace:
    """`ElasticEnvironment`, `ElasticDDPStrategy` and the commit callback for the package `pl`."""
    from importlib import import_module

    pkg = pl.__name__
    fabric = "lightning.fabric" if pkg == "lightning.pytorch" else "lightning_fabric"
    ClusterEnvironment: Any = import_module(f"{fabric}.plugins.environments").ClusterEnvironment  # noqa: N806
    DDPStrategy: Any = import_module(f"{pkg}.strategies").DDPStrategy  # noqa: N806
    Callback: Any = import_module(f"{pkg}.callbacks").Callback  # noqa: N806
    update_dataloader = import_module(f"{pkg}.utilities.data")._update_dataloader
    rank_zero_modules = [sys.modules[DDPStrategy.__module__], import_module(f"{fabric}.utilities.rank_zero")]

    class ElasticEnvironment(ClusterEnvironment):
        """Lightning's view of the elastic world: rank, size and local rank of the current generation.

        The processes are Ray actors (`creates_processes_externally`), and
        the values change at every reset, so Lightning's `global_rank`,
        `is_global_zero` and `world_size` always name the current ring.
        """

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"  # never used: the ring exists before Lightning asks

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return False  # chosen explicitly in plugins=[...], never detected

        def world_size(self) -> int:
            return elastic.size()

        def set_world_size(self, size: int) -> None:
            pass  # the driver decides the world size

        def global_rank(self) -> int:
            return elastic.rank()

        def set_global_rank(self, rank: int) -> None:
            pass  # the driver decides the ranks

        def local_rank(self) -> int:
            return elastic.local_rank()

        def node_rank(self) -> int:
            return elastic.cross_rank()

    class ElasticCommits(Callback):
        """Commits every `every` optimizer steps, checks host changes on the others, scales the LR.

        Its `state_dict` (saved in every Lightning checkpoint, hence in every
        commit) holds the training sampler's position and the world size the
        LR is scaled for.
        """

        def __init__(self, strategy: Any) -> None:
            self.strategy = strategy
            self.state: Any = None  # the run's LightningState, set by prepare_trainer's fit
            self.lr_world = 1
            self._last_step = -1

        @property
        def state_key(self) -> str:
            return "ray_elastic.ElasticCommits"

        def state_dict(self) -> dict[str, Any]:
            sampler = self.strategy.train_sampler
            return {"sampler": None if sampler is None else sampler.state_dict(), "lr_world": self.lr_world}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.lr_world = state_dict["lr_world"]
            self.strategy.pending_sampler_state = state_dict["sampler"]

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            size = elastic.size()
            if self.strategy.scale_lr:
                schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
                rescale_lr(trainer.optimizers, schedulers, size / self.lr_world)
            self.lr_world = size
            self._last_step = trainer.global_step

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.strategy.train_loader is not None:
                self.strategy.train_loader.trained(batch_idx)
            step = trainer.global_step
            if step == self._last_step or self.state is None:
                return  # gradient accumulation: no optimizer step, so nothing new to commit
            self._last_step = step
            if batch_idx + 1 >= trainer.num_training_batches:
                # The epoch's last batch: Lightning restores a checkpoint taken here as an epoch half ended and
                # miscounts the epochs after it (the next one then trains nothing). Neither a commit nor a host
                # check (which commits the live state) happens here: a commit due now is skipped, and a host
                # change is seen at the next step.
                return
            if step % self.strategy.commit_every == 0:
                self.state.commit()
            else:
                self.state.check_host_updates()

    class ElasticDDPStrategy(DDPStrategy):
        """Lightning's DDP on the elastic ring: survivors of a failure keep their process and their Trainer.

        Args:
            commit_every: optimizer steps between two in-memory commits (a
                failure rolls back to the last one; the steps in between
                check for host changes). Default 10, as `checkpoint_every`.
            scale_lr: multiply the optimizers' LRs (and what their
                schedulers compute from) by the world size, rescaled after
                every resize. Default True; False leaves the LR alone.
            **kwargs: DDPStrategy's options (`find_unused_parameters`,
                `static_graph`, ...) except `process_group`, `device_mesh`
                and `init_sync`, which the ring decides.

        Use it with `prepare_trainer(trainer)`, whose `fit` runs inside the
        elastic run loop.
        """

        strategy_name = "elastic_ddp"
        model: Any  # DDPStrategy's property: the wrapped module while fitting (an annotation only, no attribute)

        def __init__(self, commit_every: int = 10, scale_lr: bool = True, **kwargs: Any) -> None:
            if not isinstance(commit_every, int) or isinstance(commit_every, bool) or commit_every < 1:
                raise ValueError(f"commit_every must be a positive int, got {commit_every!r}")
            own = [k for k in _RING_OPTIONS if k in kwargs]
            if own:
                raise ValueError(f"ElasticDDPStrategy sets {', '.join(own)} itself (the elastic ring's process group)")
            hooks = [k for k in _COMM_HOOK_OPTIONS if kwargs.get(k) is not None]
            if hooks:
                raise ValueError(
                    f"ElasticDDPStrategy does not take {', '.join(hooks)}: the DDP is rebuilt on each generation's "
                    "ring, and its gradient allreduce carries the elastic host-change agreement"
                )
            super().__init__(**kwargs)
            self.commit_every = commit_every
            self.scale_lr = bool(scale_lr)
            self.commits = ElasticCommits(self)
            self.train_sampler: ElasticSampler | None = None
            self.train_loader: EpochLoader | None = None  # told which batches ended their step
            self.pending_sampler_state: dict[str, Any] | None = None
            self.pending_commit: dict[str, Any] | None = None  # the commit the next fit resumes from
            self._prepared: Any = None  # the last fit's ElasticDDP
            self._resumed = False
            self.in_ring = False  # inside prepare_trainer's fit, where the elastic ring exists

        # ---- the world --------------------------------------------------------------------
        def setup_distributed(self) -> None:
            # the elastic ring is already torch's default process group: Lightning must not create one
            self.set_world_ranks()

        def set_world_ranks(self) -> None:
            if not self.in_ring:
                return  # the Trainer's construction: the worker has not joined a ring yet, and must not here
            for module in rank_zero_modules:
                module.rank_zero_only.rank = elastic.rank()

        @property
        def root_device(self) -> torch.device:
            # one device per worker (Lightning indexes its devices by the local rank, which counts workers)
            return self.parallel_devices[0]

        def _configure_launcher(self) -> None:
            self._launcher = None  # Ray started the processes

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            # for validation and test loaders; the training loader gets an ElasticSampler
            return {"num_replicas": elastic.size(), "rank": elastic.rank()}

        # ---- the model --------------------------------------------------------------------
        def _setup_model(self, model: torch.nn.Module) -> Any:
            if not self._resumed:
                # no commit was loaded (the first fit): every rank starts from rank 0's parameters
                broadcast_parameters(model.state_dict(), root_rank=0)
            if self._prepared is not None:
                # The last fit's wrapper: a ring that failed mid-backward left its DDP's reducer hooked on these
                # parameters and expecting that step's gradients, and it would count the next step's too
                # ("marked ready twice"). Its reducer goes now, before another DDP hooks the same parameters.
                self._prepared._drop()
            self._prepared = prepare_model(model, move_to_device=False, **self._ddp_kwargs)
            return self._prepared

        def _register_ddp_hooks(self) -> None:
            # Lightning registers the DDP communication hook here when the root device is CUDA, asserting the model
            # is a torch DistributedDataParallel; ours is the ElasticDDP that rebuilds one per generation, and a
            # comm hook is refused at construction: nothing to register (on a GPU this used to fail every fit)
            return

        @contextmanager
        def block_backward_sync(self) -> Iterator[None]:
            no_sync = getattr(self.model, "no_sync", None)
            if no_sync is None:
                yield
            else:
                with no_sync():
                    yield

        def teardown(self) -> None:
            if self.lightning_module is not None and self.model is not self.lightning_module:
                self.model = self.lightning_module  # drop the ElasticDDP; the next fit wraps again
            super().teardown()

        # ---- the commit ---------------------------------------------------------------------
        def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            if checkpoint_path == COMMIT_PATH:
                if self.pending_commit is None:
                    raise RuntimeError("no in-memory commit to resume from")
                self._resumed = True
                return self.pending_commit
            self._resumed = True  # a user's checkpoint file: every rank loads the same one
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)

        # ---- data -------------------------------------------------------------------------
        def process_dataloader(self, dataloader: Any) -> Any:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
                return dataloader
            sampler = dataloader.sampler
            if type(sampler) is not DistributedSampler:
                logger.warning(
                    "the training DataLoader's sampler is a %s, not the DistributedSampler Lightning puts there: "
                    "it is left as it is, and samples are not kept exactly once per epoch through resizes",
                    type(sampler).__name__,
                )
                return dataloader
            elastic_sampler = ElasticSampler(
                dataloader.dataset, shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last
            )
            offset = 0
            if self.pending_sampler_state is not None:
                elastic_sampler.load_state_dict(self.pending_sampler_state)
                self.pending_sampler_state = None
                if trainer.fit_loop.restarting:
                    offset = resumed_batches(trainer.fit_loop.epoch_loop)
            elif self.train_sampler is not None:
                # a reload at an epoch's start: the new sampler starts from the old one's position
                elastic_sampler.load_state_dict(self.train_sampler.state_dict())
            # Lightning takes the loader's length now and sets the sampler's epoch only after: the length must be
            # the coming epoch's (a no-op for a restored epoch, whose progress stays)
            elastic_sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
            self.train_sampler = elastic_sampler
            rebuilt = update_dataloader(dataloader, elastic_sampler, mode=None)
            self.train_loader = EpochLoader(rebuilt, elastic_sampler, offset)
            return self.train_loader

        # ---- collectives over the current ring ----------------------------------------------
        def barrier(self, name: str | None = None) -> None:
            elastic.barrier()

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            return elastic.broadcast_object(obj, root_rank=src)

        def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
            if not isinstance(tensor, torch.Tensor):
                return tensor
            return elastic.allreduce(tensor, op=_op_name(reduce_op))

        def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
            if sync_grads:
                raise ValueError("ElasticDDPStrategy.all_gather does not carry gradients (sync_grads=True)")
            return elastic.allgather(tensor.unsqueeze(0))

        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
            votes = elastic.allreduce(torch.tensor(int(decision)), op="sum")
            return bool(votes == elastic.size()) if all else bool(votes > 0)

    return SimpleNamespace(
        pl=pl,
        ElasticEnvironment=ElasticEnvironment,
        ElasticDDPStrategy=ElasticDDPStrategy,
        ElasticCommits=ElasticCommits,
    )
