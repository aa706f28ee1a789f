"""`prepare_trainer`: one `transformers.Trainer` that trains through lost and added workers.

The Trainer keeps its own loop (`_inner_training_loop`); this module changes
what that loop stands on, on the one Trainer object it is given:

- ring: Accelerate's shared state (`PartialState`/`AcceleratorState`) is
  pointed at the current generation's rank, size and local rank before each
  entry of the loop; the ring is torch.distributed's default process group,
  which every generation re-creates, so Accelerate's and the Trainer's
  collectives run on the live ring. The model trains as
  `elastic.torch.prepare_model(model)` (set as `model_wrapped`, so
  Accelerate never wraps it in a DDP of its own): it builds a new DDP for
  every generation and never reuses one of a dead ring.
- data: the training DataLoader samples with an `ElasticSampler` (the
  Trainer's sampler and Accelerate's sharding are not used); the batches a
  step trained are recorded at the step's end, so every sample of an epoch
  is trained exactly once across resizes. HF's skipping of trained batches
  on resume is never reached (the Trainer never resumes from a checkpoint).
- state: a `TorchState` holds the model, the optimizer, the LR scheduler,
  the `TrainerState` (global step, epoch, log history, ...), the global
  random generators, Accelerate's AMP scaler when there is one and the
  sampler; it is committed every `commit_every` optimizer steps by a
  `TrainerCallback` (`on_step_end`), which checks host updates on the other
  steps. The optimizer, the scheduler and the `TrainerState` are built
  before the first entry (the Trainer builds them lazily), so a newcomer
  has objects to receive rank 0's state into.
- loop: `train()` runs inside `@elastic.run`; after a reset it enters the
  Trainer's loop again with the same objects (rolled back or synced in
  place): it goes on from the restored `global_step` in the sampler's
  epoch, `max_steps` still counts optimizer steps, and `on_train_begin`
  reaches the callbacks once per process.

Refused before training, naming the option (`refusals`): DeepSpeed, FSDP,
`push_to_hub`, `model_init`, `auto_find_batch_size`, a training set without
`__len__`, a sampling strategy other than random, several GPUs per worker,
and `train(resume_from_checkpoint=...)`.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
from typing import Any

import torch
from torch.utils.data import DataLoader

import ray_elastic as elastic
import ray_elastic.torch as elastic_torch

logger = logging.getLogger(__name__)

# TrainerState fields that say what this rank is, not where training is: never committed nor synced
_PER_RANK_FIELDS = ("is_local_process_zero", "is_world_process_zero")


# the Trainer's loop parts prepare_trainer replaces or calls: transformers 5.3 cut its loop into them
_LOOP_PARTS = ("set_initial_training_values", "_init_training_state", "_run_epoch")


def refusals(trainer: Any) -> list[str]:
    """Why `trainer` cannot train elastically, one line per reason (empty: it can)."""
    args = trainer.args
    reasons = []
    missing = [name for name in _LOOP_PARTS if not callable(getattr(trainer, name, None))]
    if missing:
        import transformers

        reasons.append(
            f"transformers {transformers.__version__}: its Trainer has no {', '.join(missing)}, the parts of the "
            "training loop the elastic Trainer stands on (transformers >= 5.3); upgrade transformers"
        )
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        reasons.append("DeepSpeed (TrainingArguments.deepspeed): its engine owns a fixed world; use plain DDP")
    if getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
        reasons.append("FSDP (TrainingArguments.fsdp): shards are tied to a fixed world size; use plain DDP")
    if getattr(args, "push_to_hub", False):
        reasons.append("push_to_hub: no network is assumed inside the workers; push the saved model yourself")
    if getattr(trainer, "model_init", None) is not None:
        reasons.append("model_init: train() would build a new model at every reset; pass model= instead")
    if getattr(args, "auto_find_batch_size", False):
        reasons.append("auto_find_batch_size: a retried batch size would differ between ranks")
    dataset = getattr(trainer, "train_dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        reasons.append("train_dataset without __len__ (or none): the elastic sampler needs a sized dataset")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if getattr(args, "group_by_length", False) or strategy not in (None, "random"):
        reasons.append(f"train_sampling_strategy={strategy!r} / group_by_length: only random sampling is elastic")
    if getattr(args, "n_gpu", 0) > 1:
        reasons.append("several GPUs per worker (DataParallel): give each worker one GPU")
    return reasons


def prepare_trainer(trainer: Any, *, commit_every: int = 10, shuffle: bool = True) -> Any:
    """Make `trainer` (a `transformers.Trainer`) elastic in place; returns the same object.

    Call it inside `train_fn`, then `trainer.train()`. Args:
        trainer: a Trainer built on every worker alike (same arguments, model config and dataset).
        commit_every: commit the state every this many optimizer steps (default 10); the steps
            in between check for host updates only. A failure redoes at most this many steps.
        shuffle: the elastic sampler's order (seeded by `args.data_seed`, else `args.seed`). Default True.

    Raises `ValueError` naming every option that cannot be elastic (see `refusals`).
    """
    reasons = refusals(trainer)
    if reasons:
        raise ValueError("this Trainer cannot train elastically:\n  - " + "\n  - ".join(reasons))
    if commit_every < 1:
        raise ValueError(f"commit_every must be >= 1, got {commit_every}")
    if getattr(trainer, "_ray_elastic", None) is not None:
        return trainer
    trainer._ray_elastic = _ElasticTrainer(trainer, commit_every, shuffle)
    return trainer


class _TrainerStateHandle:
    """The Trainer's current `TrainerState`, committed and restored in place (the Trainer keeps its object)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        fields = {k: v for k, v in vars(self._trainer.state).items() if k not in _PER_RANK_FIELDS}
        return copy.deepcopy(fields)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        live = self._trainer.state
        for key, value in copy.deepcopy(state).items():
            setattr(live, key, value)


class _RecordingLoader(DataLoader):
    """The training DataLoader: counts the batches it hands out, so a step's end can record them as trained."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out = 0
        self.recorded = 0

    def __iter__(self):  # noqa: ANN204 - a generator over DataLoader's own iterator
        self.handed_out = self.recorded = 0
        for batch in super().__iter__():
            self.handed_out += 1
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """The Trainer starts `epoch`: the sampler keeps the epoch's progress if it is already in it."""
        self.sampler.set_epoch(epoch)

    def record_trained(self) -> None:
        """Every batch handed out so far was trained (an optimizer step just ended on every rank)."""
        for i in range(self.recorded, self.handed_out):
            self.sampler.record_batch(i, self.batch_size)
        self.recorded = self.handed_out


class _ElasticTrainer:
    """What `prepare_trainer` attaches to a Trainer: the state, the sampler and the patched entry points."""

    def __init__(self, trainer: Any, commit_every: int, shuffle: bool) -> None:
        from transformers import TrainerCallback

        self.trainer = trainer
        self.commit_every = commit_every
        self._original = {name: getattr(trainer, name) for name in ("train", *_LOOP_PARTS)}
        self._began = False  # on_train_begin reached the callbacks in this process
        args = trainer.args
        self.epoch_based = args.max_steps <= 0
        elastic.rank()  # joins the ring, so Accelerate can be pointed at it
        _point_accelerate_at_ring()

        seed = args.data_seed if getattr(args, "data_seed", None) is not None else args.seed
        self.sampler = elastic_torch.ElasticSampler(trainer.train_dataset, shuffle=shuffle, seed=seed)
        self.loader = self._build_loader()

        # built now, not lazily inside train(): a newcomer needs them to receive rank 0's state into
        max_steps, epochs = self._plan(self.sampler.num_remaining, 0)
        trainer._init_training_state = self._original["_init_training_state"]
        trainer._init_training_state(max_steps, 1, epochs, None, None)
        raw = trainer.optimizer if trainer.optimizer is not None else trainer.create_optimizer()
        if trainer.lr_scheduler is None:
            trainer.create_scheduler(num_training_steps=max_steps, optimizer=raw)
        # prepared once: Accelerate returns an optimizer it prepared before as it is on every later entry
        trainer.optimizer = trainer.accelerator.prepare_optimizer(raw)
        model = trainer.accelerator.prepare_model(trainer.model, evaluation_mode=True)  # device, autocast; no DDP
        trainer.model_wrapped = elastic_torch.prepare_model(model)

        parts: dict[str, Any] = {
            "optimizer": raw,
            "sampler": self.sampler,
            "scheduler": trainer.lr_scheduler,
            "trainer_state": _TrainerStateHandle(trainer),
            "rng": True,
        }
        if getattr(trainer.accelerator, "scaler", None) is not None:
            parts["scaler"] = trainer.accelerator.scaler
        self.state = elastic_torch.TorchState(model=trainer.model, **parts)

        adapter = self

        class _StepEnd(TrainerCallback):
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                adapter.step_ended()

        trainer.add_callback(_StepEnd())
        trainer.get_train_dataloader = lambda: self.loader
        trainer.set_initial_training_values = self._initial_training_values
        trainer._init_training_state = self._keep_training_state
        trainer._run_epoch = self._run_epoch
        trainer.train = self.train
        trainer.push_to_hub = _refuse_push_to_hub
        handler = trainer.callback_handler
        begin = handler.on_train_begin

        def on_train_begin(args: Any, state: Any, control: Any) -> Any:
            return begin(args, state, control) if self._first_begin() else control

        handler.on_train_begin = on_train_begin
        # Every entry of train() starts with Accelerate's free_memory(), whose gc.collect() walks every object of
        # the process (0.3 s with torch and transformers loaded), and train() is entered again after each reset.
        # What exists now (modules, model, optimizer) lives as long as the worker: frozen out of the collector's
        # walks, a reset's collection only sees what was made since.
        gc.freeze()

    # ---- entry points ------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None, **kwargs: Any) -> Any:
        """`Trainer.train()`, inside the elastic run loop; returns the Trainer's `TrainOutput`."""
        if resume_from_checkpoint not in (None, False):
            raise ValueError(
                "train(resume_from_checkpoint=...) is not elastic: the run resumes from ray-elastic's own "
                "commits (and ElasticTrainer(checkpoint_dir=...) for whole-cluster restarts)"
            )
        if trial is not None:
            raise ValueError("hyper-parameter search trials are not supported by prepare_trainer; use Ray Tune")

        @elastic.run
        def run(state: Any) -> Any:
            self._enter_generation()
            return self._original["train"](**kwargs)

        return run(self.state)

    def step_ended(self) -> None:
        """An optimizer step ended on every rank: record its batches, then commit or check host updates."""
        self.loader.record_trained()
        tstate = self.trainer.state
        n = len(self.trainer.train_dataset)
        tstate.epoch = self.sampler.epoch + self.sampler.num_processed / n  # not the Trainer's share of one entry
        if tstate.global_step >= tstate.max_steps:
            return  # the last step: nothing after it to save for, nor a newcomer to train with
        if tstate.global_step % self.commit_every == 0:
            self.state.commit()
        else:
            self.state.check_host_updates()

    # ---- one generation ----------------------------------------------------------------------

    def _enter_generation(self) -> None:
        """Before each entry of the Trainer's loop: the ring's view, rank-0 flags, sampler world, step plan."""
        trainer = self.trainer
        _point_accelerate_at_ring()
        self.sampler.set_world(elastic.rank(), elastic.size())
        tstate = trainer.state
        tstate.is_local_process_zero = trainer.is_local_process_zero()
        tstate.is_world_process_zero = trainer.is_world_process_zero()
        trainer._created_lr_scheduler = False  # else the loop drops the scheduler the state holds
        if self.epoch_based:
            max_steps, _ = self._plan(self.sampler.num_remaining, self.sampler.epoch)
            max_steps += tstate.global_step
            if max_steps != tstate.max_steps:
                logger.warning(
                    "rank %d: %d workers now: the epochs left take %d optimizer steps, so the run ends at "
                    "step %d (was %d); the LR schedule keeps the length it was built with",
                    elastic.rank(),
                    elastic.size(),
                    max_steps - tstate.global_step,
                    max_steps,
                    tstate.max_steps,
                )
                tstate.max_steps = max_steps

    def _plan(self, remaining: int, epoch: int) -> tuple[int, int]:
        """(optimizer steps, epochs) from `remaining` samples of `epoch` on, at the current world size."""
        args = self.trainer.args
        size = elastic.size()
        epochs = math.ceil(args.num_train_epochs)
        if not self.epoch_based:
            return args.max_steps, epochs
        steps = _updates(remaining, size, self.loader.batch_size, args.gradient_accumulation_steps)
        full = _updates(len(self.trainer.train_dataset), size, self.loader.batch_size, args.gradient_accumulation_steps)
        return steps + max(0, epochs - epoch - 1) * full, epochs

    def _initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        values = list(self._original["set_initial_training_values"](args, dataloader))
        tstate = self.trainer.state
        values[-1] = tstate.max_steps  # fixed at the start (max_steps) or by _enter_generation (epochs)
        if not self.epoch_based:
            # the run stops at max_steps; every epoch has at least one step, so this many epochs always suffice
            values[0] = self.sampler.epoch + tstate.max_steps + 1
        return tuple(values)

    def _keep_training_state(self, max_steps: int, *args: Any) -> tuple[int, int]:
        """The loop's TrainerState is the one the elastic state holds: entered at the sampler's epoch."""
        return self.sampler.epoch, 0

    def _run_epoch(self, **kwargs: Any) -> Any:
        """One epoch of the Trainer's loop, sized by what the sampler has left of it at this world size."""
        trainer = self.trainer
        epoch = kwargs["epoch"]
        self.loader.set_epoch(epoch)
        if trainer.state.global_step >= trainer.state.max_steps:
            trainer.control.should_training_stop = True
            return None
        if self.sampler.num_remaining == 0:
            return None  # the epoch was trained to its end before the reset
        steps = len(self.loader)
        ga = trainer.args.gradient_accumulation_steps
        kwargs["steps_in_epoch"] = steps
        kwargs["num_update_steps_per_epoch"] = max(steps // ga + int(steps % ga > 0), 1)
        return self._original["_run_epoch"](**kwargs)

    def _first_begin(self) -> bool:
        began, self._began = self._began, True
        return not began

    def _build_loader(self) -> _RecordingLoader:
        trainer, args = self.trainer, self.trainer.args
        dataset = trainer.train_dataset
        try:
            import datasets

            is_hf_dataset = isinstance(dataset, datasets.Dataset)
        except ImportError:
            is_hf_dataset = False
        collator = trainer.data_collator
        if is_hf_dataset:
            dataset = trainer._remove_unused_columns(dataset, description="training")
        else:
            collator = trainer._get_collator_with_removed_columns(collator, description="training")
        return _RecordingLoader(
            dataset,
            batch_size=trainer._train_batch_size,
            sampler=self.sampler,
            collate_fn=collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            drop_last=False,  # the sampler pads to an even split; dropping a batch would leave samples untrained
        )


def _updates(samples: int, size: int, batch_size: int, accumulation: int) -> int:
    """Optimizer steps that `samples` take on `size` ranks (the sampler pads to an even split)."""
    batches = math.ceil(math.ceil(samples / size) / batch_size)
    return batches // accumulation + int(batches % accumulation > 0)


def _point_accelerate_at_ring() -> None:
    """Make Accelerate's shared state (and so the Trainer's `args.process_index` ...) the current ring's."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    device = elastic_torch.get_device()
    view = {
        "process_index": elastic.rank(),
        "num_processes": elastic.size(),
        "local_process_index": elastic.local_rank(),
        "distributed_type": DistributedType.MULTI_GPU if device.type == "cuda" else DistributedType.MULTI_CPU,
        "backend": dist.get_backend() if dist.is_initialized() else None,
    }
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        if shared:
            shared.update(view)


def _refuse_push_to_hub(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        "push_to_hub is refused under ray-elastic (no network is assumed inside the workers): "
        "save_model() on rank 0, then push the directory from a machine with network access"
    )
