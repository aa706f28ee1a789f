"""`prepare_trainer`: a Lightning Trainer whose `fit` runs inside the elastic run loop.

The returned Trainer is the same object, with its `fit` replaced: each call
runs `@elastic.run` around Lightning's own `fit`. A ring failure raises out
of Lightning's loop; the run loop rolls the `LightningState` back to the
last commit, rebuilds the ring, and calls Lightning's `fit` again on the
same Trainer, which resumes from the commit (Lightning's checkpoint restore:
weights, optimizers, schedulers, loops, callbacks). A host change does the
same from the live state, committed at that step. Newcomers receive rank
0's commit in the run loop's sync before their first `fit`.
"""

from __future__ import annotations

import copy
import functools
import importlib
from typing import Any

import ray_elastic as elastic
from ray_elastic.lightning.core import COMMIT_PATH, build

_BUILT: dict[str, Any] = {}
# strategies whose model state is sharded over the ranks: a rank's commit is not the whole model
_SHARDED = ("FSDP", "DeepSpeed", "ModelParallel", "XLA")


def classes_for(package: str) -> Any:
    """The elastic classes for `package` ("lightning.pytorch" or "pytorch_lightning"), built once."""
    if package not in _BUILT:
        _BUILT[package] = build(importlib.import_module(package))
    return _BUILT[package]


def _package_of(trainer: Any) -> str:
    module = type(trainer).__module__
    if module.startswith("lightning.pytorch"):
        return "lightning.pytorch"
    if module.startswith("pytorch_lightning"):
        return "pytorch_lightning"
    kind = f"{type(trainer).__module__}.{type(trainer).__name__}"
    raise TypeError(f"prepare_trainer takes a Lightning Trainer, got {kind}")


class LightningState(elastic.ObjectState):
    """The last commit of a Trainer: Lightning's checkpoint dict, copied in memory.

    `save()` dumps the live Trainer; `restore()` and `sync()` (from
    `ObjectState`) put the committed dict back, and the next `fit` resumes
    from it. A graceful host change commits at the step it is found
    (`check_host_updates`), so the live state is the commit then.
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._live_saved = False
        super().__init__(ckpt=None)

    def save(self) -> None:
        if self._trainer.lightning_module is not None and self._trainer.lightning_module._trainer is not None:
            self.ckpt = self._trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        super().save()
        self.ckpt = None  # the dump shares the live tensors: only the copy in the commit is kept

    def check_host_updates(self) -> None:
        try:
            super().check_host_updates()
        except elastic.HostsUpdatedInterrupt:
            self.save()  # the live state at this step, while Lightning's loop still holds it
            self._live_saved = True
            raise

    def restore(self) -> None:
        pass  # the commit stays where it is: the next fit resumes from it (commit_to_resume)

    def keep_live(self) -> None:
        if not self._live_saved:
            self.save()
        self._live_saved = False

    def commit_to_resume(self) -> dict[str, Any] | None:
        """A private copy of the last commit for Lightning to load (it may keep references to it)."""
        return copy.deepcopy(self._saved["ckpt"])


def enter_fit(strategy: Any, state: LightningState, ckpt_path: Any) -> Any:
    """Ready `strategy` for one (re-)entry into Lightning's `fit`; the `ckpt_path` that fit resumes from.

    The last commit when there is one (after a reset, or a newcomer's sync),
    else the user's own `ckpt_path` (the first entry).
    """
    commit = state.commit_to_resume()
    strategy.pending_commit = commit
    strategy._resumed = False
    strategy.pending_sampler_state = None
    strategy.train_sampler = None
    strategy.in_ring = True
    return COMMIT_PATH if commit is not None else ckpt_path


def _refuse_non_elastic(trainer: Any) -> None:
    strategy = type(trainer.strategy).__name__
    if any(name in strategy for name in _SHARDED):
        raise ValueError(
            f"prepare_trainer: the {strategy} strategy shards the model over the ranks, so no rank holds a whole "
            "commit to hand to a newcomer; use ElasticDDPStrategy"
        )
    for callback in trainer.callbacks:
        if type(callback).__name__ == "Timer" and getattr(callback, "_duration", None) is not None:
            raise ValueError(
                "prepare_trainer: max_time (Lightning's Timer) counts each process's own time and is not restored "
                "with the loops, so it cannot follow a rollback; use max_epochs or max_steps"
            )
    devices = len(getattr(trainer.strategy, "parallel_devices", None) or [None])
    if devices > 1 or trainer.num_nodes > 1:
        raise ValueError(
            f"prepare_trainer: each Ray worker is one rank; build the Trainer with devices=1 and num_nodes=1 "
            f"(got devices={devices}, num_nodes={trainer.num_nodes}) and set the number of workers on ElasticTrainer"
        )


def _install_strategy(trainer: Any, found: Any) -> Any:
    """The Trainer's ElasticDDPStrategy; a Trainer built with Lightning's defaults gets one here."""
    strategy = trainer.strategy
    if isinstance(strategy, found.ElasticDDPStrategy):
        if not isinstance(strategy.cluster_environment, found.ElasticEnvironment):
            # Lightning picked its own environment (no plugins=[ElasticEnvironment()]): ranks must be the ring's
            strategy.cluster_environment = found.ElasticEnvironment()
            trainer._accelerator_connector.cluster_environment = strategy.cluster_environment
        return strategy
    if type(strategy).__name__ not in ("SingleDeviceStrategy", "DDPStrategy"):
        raise ValueError(
            f"prepare_trainer: the {type(strategy).__name__} strategy cannot be made elastic; pass "
            "strategy=ElasticDDPStrategy() (or leave Lightning's default strategy)"
        )
    elastic_strategy = found.ElasticDDPStrategy(
        accelerator=strategy.accelerator,
        parallel_devices=[strategy.root_device],
        precision_plugin=strategy.precision_plugin,
        cluster_environment=found.ElasticEnvironment(),
    )
    trainer._accelerator_connector.strategy = elastic_strategy
    trainer._accelerator_connector.cluster_environment = elastic_strategy.cluster_environment
    return elastic_strategy


def prepare_trainer(trainer: Any) -> Any:
    """Make `trainer` elastic in place and return it: its `fit` runs inside `@elastic.run`.

    Call it in `train_fn`, on a Trainer built with
    `strategy=ElasticDDPStrategy(), plugins=[ElasticEnvironment()]`, or with
    Lightning's default strategy (which is replaced by an
    `ElasticDDPStrategy()`). Lightning's `fit` is then entered again after
    every reset, from the last commit. Training loaders are reloaded at each
    epoch (the number of batches per rank follows the world size).

    Raises:
        ValueError: a feature that cannot be elastic, named: a sharded
            strategy (FSDP, DeepSpeed), `max_time`, several devices or nodes
            per worker.
        TypeError: not a Lightning Trainer.
    """
    found = classes_for(_package_of(trainer))
    _refuse_non_elastic(trainer)
    strategy = _install_strategy(trainer, found)
    if strategy.commits not in trainer.callbacks:
        trainer.callbacks.append(strategy.commits)
    # the loader's batches per rank change with the world size: Lightning must ask for its length each epoch
    trainer.reload_dataloaders_every_n_epochs = 1
    lightning_fit = trainer.fit

    @functools.wraps(lightning_fit)
    def fit(model: Any, *args: Any, ckpt_path: Any = None, **kwargs: Any) -> None:
        state = LightningState(trainer)
        strategy.commits.state = state

        @elastic.run
        def train(state: LightningState) -> None:
            lightning_fit(model, *args, ckpt_path=enter_fit(strategy, state, ckpt_path), **kwargs)

        try:
            train(state)
        finally:
            strategy.commits.state = None
            strategy.in_ring = False
            strategy.pending_commit = None

    trainer.fit = fit
    return trainer
