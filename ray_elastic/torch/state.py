"""`TorchState`: models, optimizers and samplers that survive resets, at a cost that does not grow with them.

Each attribute gets a handler chosen by its type (`register_handler` lets
users add their own types):

- `Module`: parameters and buffers;
- `Optimizer` (or a `DistributedOptimizer` around one): per-parameter state
  (momentum, Adam moments, step counts) and the param groups'
  hyper-parameters (learning rate ...);
- `ElasticSampler`: its epoch and processed-sample bitmap;
- anything else: deep copies, as in `ObjectState`.

The handlers live in modules of their own (`module_handler.py`,
`optimizer_handler.py`, `sampler_handler.py`, `state_dict_handler.py`, and
`handler.py`'s `ObjectHandler`); this module picks one per attribute and
runs them together.

Commit: `save()` (the first half of `commit()`) copies every tensor into a
buffer allocated once and reused (`commit_buffers.py`), so a commit costs about one tensor copy of
the state and holds one extra copy of it: no deepcopy, no pickling. Every
commit carries a `CommitId` (see `ray_elastic.state.sync_plan`).

Restore, after a failure: tensors that an optimizer of this state steps
(its parameters and its moments) are not copied back: each live tensor
trades its storage with its buffer (`tensor.data`, so parameters keep their
identity and the optimizer's references stay valid), and the buffers are
refilled from the restored tensors on a background thread (which holds off
while this process sends or receives a sync's state, or a reset runs:
`copy_gate.py`). The optimizer's
next `step()` waits for that copy (a step pre-hook), so the rollback never
waits for a copy of the model, and the commit is whole again before anything
changes the tensors. A rank whose optimizer did not step since the commit
has nothing to restore. Other tensors (module buffers such as BatchNorm's
running statistics, parameters no optimizer of this state steps) are copied
back, as before. Tensors an optimizer steps must change only through it
between a reset and its next step. On a GPU nothing trades storage: the
commit's copies are queued on the loop's current stream and a rollback
copies into the live tensors, which keep their addresses (CUDA graphs stay
valid); see `commit_buffers.py`. A durable checkpoint holds host copies.

Sync, after a reset: the ranks agree with one tiny allreduce on which of
them hold rank 0's commit (`ray_elastic.state.transfer.agree`). Those move
nothing. The others (newcomers, a rank whose last commit differs) receive a
small description of rank 0's state (the optimizer's structure, the
sampler's epoch, the plain values) and then its tensors in chunks, from all
holders at once (`ray_elastic.torch.broadcast.send_tensors_`); their new
commit is then copied on a background thread as after a restore. A handler
takes part through `describe / receive / tensors / received / after_sync`;
a user handler that implements only `sync()` is synced by it, on every
rank, whenever some rank needs state.

Worker: a `TorchState` commits to and syncs over one worker runtime,
`TorchState(..., worker=...)`, by default the process's, found once at
construction (see `State`). Rank 0 publishes its optimizers' layout in that
worker's lasting KV, a newcomer's warm-up is registered with it, and the
sampler handlers take their ring from it: none of them looks the process up.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
from typing import TYPE_CHECKING, Any

import torch

from ray_elastic.runtime.commits import fresh_commit_id
from ray_elastic.runtime.process import maybe_current
from ray_elastic.state.reshard_plan import ShardLostError
from ray_elastic.state.state import State, SyncReport
from ray_elastic.state.transfer import agree, share_object
from ray_elastic.torch import copy_gate
from ray_elastic.torch.broadcast import send_tensors_
from ray_elastic.torch.data_loader import ElasticDataLoader
from ray_elastic.torch.grad_scaler_handler import GradScalerHandler
from ray_elastic.torch.handler import ObjectHandler, StateHandler, _moves_only_what_is_needed
from ray_elastic.torch.heap import warm_heap
from ray_elastic.torch.module_handler import ModuleHandler
from ray_elastic.torch.optimizer import DistributedOptimizer
from ray_elastic.torch.optimizer_handler import OptimizerHandler
from ray_elastic.torch.rng import RngState
from ray_elastic.torch.sampler import ElasticSampler
from ray_elastic.torch.sampler_handler import SamplerHandler
from ray_elastic.torch.sharded import fsdp2
from ray_elastic.torch.sharded.handler import OwnedOptimizer, ShardedHandler
from ray_elastic.torch.state_dict_handler import StateDictHandler, saves_itself

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.collective.base import CollectiveGroup
    from ray_elastic.runtime.context import WorkerContext
    from ray_elastic.runtime.generation import Generation
    from ray_elastic.state.sync_plan import SyncPlan

logger = logging.getLogger(__name__)
_state_numbers = itertools.count()  # each TorchState of this process, in construction order


_REGISTRY: list[tuple[type, Callable[[Any], StateHandler]]] = []


def register_handler(value_type: type, factory: Callable[[Any], StateHandler]) -> None:
    """Use `factory(value)` for attributes of `value_type` (newest registration wins)."""
    _REGISTRY.insert(0, (value_type, factory))


def _handler_for(value: Any, worker: WorkerContext | None) -> StateHandler:
    for value_type, factory in _REGISTRY:
        if isinstance(value, value_type):
            return factory(value)
    if isinstance(value, torch.nn.Module):
        return ModuleHandler(value)
    if isinstance(value, torch.optim.Optimizer):  # a DistributedOptimizer too
        return OptimizerHandler(value)
    if isinstance(value, (ElasticSampler, ElasticDataLoader)):  # a loader: its sampler's position, the loader kept
        return SamplerHandler(value, worker)
    if isinstance(value, torch.amp.GradScaler):  # committed without reading its tensors (no device wait)
        return GradScalerHandler(value)
    if saves_itself(value):  # a scheduler, an EMA: restored in place, never replaced by a copy
        return StateDictHandler(value)
    return ObjectHandler(value)


def _handlers_for(values: dict[str, Any], worker: WorkerContext | None) -> dict[str, StateHandler]:
    """A handler per attribute; a sharded model's handler also takes the optimizers that step it.

    `worker`'s generation, when it is in one, is the world a sharded model
    must fit; None: outside a worker (the model's own mesh then).
    """
    handlers: dict[str, StateHandler] = {}
    for name, model in values.items():
        if not fsdp2.is_sharded(model):
            continue
        now = None if worker is None else worker.generation_now()
        world = now.ring.size if now is not None else fsdp2.mesh_size(model)
        refused = fsdp2.refusal(model, world)
        if refused is not None:
            raise fsdp2.ShardingRefused(f"TorchState({name}=...): {refused}")
        params = {id(p) for p in model.parameters()}
        stepping = [
            (n, v)
            for n, v in values.items()
            if isinstance(v, torch.optim.Optimizer)
            and any(id(p) in params for g in v.param_groups for p in g["params"])
        ]
        for n, opt in stepping:
            if isinstance(opt, DistributedOptimizer):
                raise fsdp2.ShardingRefused(
                    f"TorchState({n}=...): a DistributedOptimizer averages whole gradients, but {name!r} is sharded "
                    "(fully_shard reduces its gradients itself): pass the plain optimizer"
                )
            handlers[n] = OwnedOptimizer(opt)
        handlers[name] = ShardedHandler(model, [opt for _, opt in stepping], worker)
    return {k: handlers.get(k) or _handler_for(v, worker) for k, v in values.items()}


class TorchState(State):
    """State of a PyTorch training loop: `TorchState(model=m, optimizer=o, sampler=s, scheduler=sc, epoch=0)`.

    Anything with `state_dict()`/`load_state_dict()` (an LR scheduler, a
    `GradScaler`, an EMA) is restored in place: the object the loop holds is
    the one that rolls back. `rng=True` adds the global random generators.

    Attributes read and write through to their handlers, so `state.epoch = 3`
    is what the next `commit()` saves. `last_sync` says what the last sync
    moved (a `SyncReport`).

    Args:
        model: a `torch.nn.Module` (also as any other name).
        optimizer: a `torch.optim.Optimizer` or `DistributedOptimizer`.
        worker: the worker runtime it commits to and syncs over (keyword
            only, so no attribute may be named `worker`); None (the
            default): this process's, found once, here.
        kwargs: the other attributes, each with the handler of its type.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: Any = None,
        *,
        worker: WorkerContext | None = None,
        **kwargs: Any,
    ) -> None:
        worker = worker if worker is not None else maybe_current()
        values = dict(kwargs)
        if values.get("rng") is True:  # the global generators roll back with the state (see `RngState`)
            values["rng"] = RngState()
        if model is not None:
            values["model"] = model
        if optimizer is not None:
            values["optimizer"] = optimizer
        object.__setattr__(self, "_handlers", _handlers_for(values, worker))
        object.__setattr__(self, "_hooked", {})  # id(optimizer) -> (optimizer, its step pre-hook's handle)
        # where rank 0 publishes its optimizers' layout for newcomers: states are built in the same order everywhere
        object.__setattr__(self, "_layout_key", f"torch_state_layout/{next(_state_numbers)}")
        object.__setattr__(self, "_published", None)
        super().__init__(worker)
        # no collective in this first commit: a newcomer of a Horovod script is already in the ring when it
        # builds its state, while the survivors wait in their sync's agreement (the two would never meet);
        # the sync right after gives every rank rank 0's state
        self._save(later=False, collectives=False)
        if worker is not None:
            worker.add_join_preparation(self._prepare_newcomer)

    def __getattr__(self, name: str) -> Any:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            return handlers[name].value
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
        else:
            object.__setattr__(self, name, value)

    def _guard(self) -> None:
        """Hook every optimizer of this state (once), and tell the handlers which tensors those step."""
        stepped: set[int] = set()
        for handler in self._handlers.values():
            if isinstance(handler, OptimizerHandler):
                opt = handler.optimizer
                if id(opt) not in self._hooked:
                    self._hooked[id(opt)] = (opt, opt.register_step_pre_hook(self._before_step))
                stepped.update(id(p) for p in handler._params())
        for handler in self._handlers.values():
            handler.guard(stepped)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for handler in self._handlers.values():
            handler.touched()

    def save(self) -> None:
        self._save(later=False)

    def keep_live(self) -> None:
        """Make the live state the commit; the tensors an optimizer steps are copied in the background.

        The run loop calls it when hosts changed gracefully: a reset follows,
        and the copy waits until its sync has returned (or the copy is waited for).
        """
        copy_gate.hold_background_copies()
        self._save(later=True)

    def _save(self, later: bool, collectives: bool = True) -> None:
        self._guard()
        for handler in self._handlers.values():
            if collectives:
                handler.prepare_save()
        after = self.commit_id.next()
        self.commit_id = fresh_commit_id()  # until every handler saved, this is nobody's commit
        for handler in self._handlers.values():
            if later:
                handler.keep_live()
            else:
                handler.save()
        self.commit_id = after
        for handler in self._sharded():
            handler.committed(after.fingerprint())
            if collectives:
                handler.replicate(self.worker_context().joined().ring)
        self._publish_layout()

    def _sharded(self) -> list[ShardedHandler]:
        return [h for h in self._handlers.values() if isinstance(h, ShardedHandler)]

    def _publish_layout(self) -> None:
        """On rank 0: put its optimizers' state layout in the run's KV when it changed (a few KB, not awaited)."""
        now = None if self._worker is None else self._worker.generation_now()
        if now is None or now.ring.rank != 0:
            return
        layouts = {n: h.layout() for n, h in self._handlers.items() if isinstance(h, OptimizerHandler) and h.layout()}
        if layouts and layouts != self._published:
            self.worker_context().post_lasting(self._layout_key, pickle.dumps(layouts))
            object.__setattr__(self, "_published", layouts)

    def _prepare_newcomer(self) -> None:
        """Before this worker first says it is ready: allocate and fault in what rank 0's commit will send."""
        raw = None if self._worker is None else self._worker.get_lasting(self._layout_key)
        if raw is None:
            return  # the run's first workers, or no optimizer state yet
        started = time.perf_counter()
        nbytes = 0
        for name, layout in pickle.loads(raw).items():
            handler = self._handlers.get(name)
            if isinstance(handler, OptimizerHandler):
                nbytes += handler.prepare(layout)
        # the pages of the first backward's gradients (that step is the one the survivors wait on)
        trained = [p for h in self._handlers.values() if isinstance(h, ModuleHandler) for p in h.value.parameters()]
        warmed = warm_heap(self._held_at_once([p for p in trained if p.requires_grad]))
        logger.info(
            "prepared %.0f MB of optimizer state and commit buffers, warmed %.0f MB of heap, in %.3f s",
            nbytes / 1e6,
            warmed / 1e6,
            time.perf_counter() - started,
        )

    def _held_at_once(self, trained: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters whose gradients a backward holds at once, as far as this state can tell.

        A `DistributedOptimizer` frees autograd's gradients bucket by bucket
        during backward, so the next buckets' gradients take the same blocks:
        its largest bucket stands for all of its parameters. Any other
        parameter's gradient lives until the step.
        """
        bucketed: set[int] = set()
        largest: list[torch.Tensor] = []
        for handler in self._handlers.values():
            if isinstance(handler, OptimizerHandler) and isinstance(handler.value, DistributedOptimizer):
                buckets = handler.value._buckets
                bucketed.update(id(p) for b in buckets for p in b.params)
                largest.extend(max(buckets, key=lambda b: b.flat.numel()).params)
        return [p for p in trained if id(p) not in bucketed] + largest

    def restore(self) -> None:
        """Back to the last commit; the commit's re-copy waits until the reset's sync has returned."""
        copy_gate.hold_background_copies()
        for handler in self._handlers.values():
            handler.restore()

    def restore_before_sync(self) -> None:
        """`restore()`, but a sharded model's rows are left to the sync's reshard, which sets them from the commit.

        The reshard copies every row of the new layout out of the committed
        buffers whatever the live rows hold, so restoring them first would
        copy the whole shard twice (0.2-0.4 s at 100M parameters on two busy
        cores, on the recovery's path). Until the sync, reset callbacks see
        a sharded model's rows as they were at the failure.
        """
        copy_gate.hold_background_copies()
        for handler in self._handlers.values():
            if isinstance(handler, ShardedHandler):
                handler.restore(rows=False)
            else:
                handler.restore()

    def sync(self) -> None:
        """Rank 0's commit on every rank, moving state only to the ranks that do not hold it."""
        try:
            self._sync()
        finally:
            copy_gate.release_background_copies()

    def _sync(self) -> None:
        started = time.perf_counter()
        generation = self.worker_context().joined()
        ring = generation.ring
        for sharded in self._sharded():  # every rank takes part: each holds a part of the state
            try:
                sharded.reshard(ring, self.commit_id.fingerprint())
            except ShardLostError as lost:  # every rank raises it: the plan is the same everywhere
                self._fall_back(generation, sharded, lost)
        plan = agree(ring, self.commit_id)
        agreed = time.perf_counter() - started
        received = 0
        if plan.moves_state:
            received = self._transfer(ring, plan)
            # every rank's receive done before any rank's held commit copy starts: a holder's copy of a large
            # commit, run beside a newcomer's last receives, competes with them for memory bandwidth
            ring.max_int(0)
        for handler in self._handlers.values():
            handler.after_sync()
        self.last_sync = SyncReport(plan.holders, plan.receivers, received, time.perf_counter() - started, agreed)

    def _fall_back(self, generation: Generation, sharded: ShardedHandler, lost: ShardLostError) -> None:
        """Rows lost with their replica: every rank goes back to the newest durable checkpoint, if there is one."""
        worker, ring = self.worker_context(), generation.ring
        found = False
        if ring.rank == 0:
            found = worker.fall_back_to_durable(generation, self, f"resharding lost rows ({lost})")
        found, commits = ring.broadcast_object((found, worker.commits), root_rank=0)
        if not found:
            raise lost
        worker.commits = commits  # every rank counts from the checkpoint's commit: the next durable one is alike
        sharded.reshard(ring, self.commit_id.fingerprint())  # rank 0 now describes the checkpoint to load

    def _transfer(self, ring: CollectiveGroup, plan: SyncPlan) -> int:
        moving = {
            name: h
            for name, h in self._handlers.items()
            if _moves_only_what_is_needed(h) and not isinstance(h, (ShardedHandler, OwnedOptimizer))
        }
        described = None
        if ring.rank == 0:
            described = (self.commit_id, {name: h.describe() for name, h in moving.items()})
        described = share_object(ring, plan, described)
        if plan.receives:
            commit_id, descriptions = described
            for name, handler in moving.items():
                handler.touched()  # a transfer cut short leaves torn tensors: a restore must bring the commit back
                handler.receive(descriptions[name])
        received = send_tensors_(ring, plan, [t for h in moving.values() for t in h.tensors()])
        for name, handler in self._handlers.items():
            if name not in moving and not isinstance(handler, (ShardedHandler, OwnedOptimizer)):
                # a user handler with only sync(): its own broadcast, on every rank
                handler.sync()
                handler.save()
        if plan.receives:
            # the commit of what it received is copied after the sync, as the holders' are: a copy running
            # beside the sync's last allreduce would lengthen the sync
            copy_gate.hold_background_copies()
            for handler in moving.values():
                handler.received()
            self.commit_id = commit_id
        self._guard()
        return received

    def write_shards(self, directory: str) -> bool:
        """Every rank, right after a commit: write its sharded model's rows under `directory` (DCP's format).

        False (and nothing written) for a state without a sharded model,
        whose durable checkpoint rank 0 writes alone.
        """
        sharded = self._sharded()
        for index, handler in enumerate(sharded):
            handler.write_durable(directory if len(sharded) == 1 else f"{directory}/{index}")
        return bool(sharded)

    def checkpoint_payload(self) -> dict[str, Any]:
        return {name: handler.snapshot() for name, handler in self._handlers.items()}

    def load_checkpoint(self, payload: dict[str, Any]) -> None:
        if set(payload) != set(self._handlers):
            raise ValueError(f"the checkpoint holds {sorted(payload)}, this TorchState holds {sorted(self._handlers)}")
        for name, handler in self._handlers.items():
            try:
                handler.load_snapshot(payload[name])
            except ValueError as e:  # name the attribute: a checkpoint_dir of another experiment?
                raise ValueError(f"the checkpoint does not fit this TorchState's {name!r}: {e}") from e
        self.commit_id = fresh_commit_id()  # a state no other rank holds: the sync hands it to them
