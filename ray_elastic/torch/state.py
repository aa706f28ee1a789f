"""`TorchState`: models, optimizers and samplers that survive resets, at a cost that does not grow with them.

Each attribute gets a handler chosen by its type (`register_handler` lets
users add their own types):

- `Module`: parameters and buffers;
- `Optimizer` (or a `DistributedOptimizer` around one): per-parameter state
  (momentum, Adam moments, step counts) and the param groups'
  hyper-parameters (learning rate ...);
- `ElasticSampler`: its epoch and processed-sample bitmap;
- anything else: deep copies, as in `ObjectState`.

Commit: `save()` (the first half of `commit()`) copies every tensor into a
buffer allocated once and reused, so a commit costs about one tensor copy of
the state and holds one extra copy of it: no deepcopy, no pickling. Every
commit carries a `CommitId` (see `ray_elastic.state.sync_plan`).

Restore, after a failure: tensors that an optimizer of this state steps
(its parameters and its moments) are not copied back: each live tensor
trades its storage with its buffer (`tensor.data`, so parameters keep their
identity and the optimizer's references stay valid), and the buffers are
refilled from the restored tensors on a background thread (which holds off
while this process sends or receives a sync's state). The optimizer's
next `step()` waits for that copy (a step pre-hook), so the rollback never
waits for a copy of the model, and the commit is whole again before anything
changes the tensors. A rank whose optimizer did not step since the commit
has nothing to restore. Other tensors (module buffers such as BatchNorm's
running statistics, parameters no optimizer of this state steps) are copied
back, as before. Tensors an optimizer steps must change only through it
between a reset and its next step.

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
"""

from __future__ import annotations

import copy
import itertools
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ray_elastic.collective.base import CollectiveGroup
from ray_elastic.runtime.allocator import is_tuned
from ray_elastic.runtime.commits import fresh_commit_id
from ray_elastic.runtime.process import maybe_current
from ray_elastic.runtime.ring_ops import group as current_ring
from ray_elastic.state.pages import can_populate, populate_range
from ray_elastic.state.state import State, SyncReport
from ray_elastic.state.sync_plan import SyncPlan
from ray_elastic.state.transfer import agree, share_object
from ray_elastic.torch.broadcast import send_tensors_, wait_while_transferring
from ray_elastic.torch.data_loader import ElasticDataLoader
from ray_elastic.torch.handler import CopiedHandler, StateHandler, _moves_only_what_is_needed, _sync_from_rank0
from ray_elastic.torch.optimizer import DistributedOptimizer
from ray_elastic.torch.rng import RngState
from ray_elastic.torch.sampler import ElasticSampler
from ray_elastic.torch.state_dict_handler import StateDictHandler, saves_itself

logger = logging.getLogger(__name__)
_state_numbers = itertools.count()  # each TorchState of this process, in construction order


def _faulted_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose pages are already faulted in (zeroed where that is the only way)."""
    t = torch.empty(shape, dtype=dtype)
    if not (can_populate() and populate_range(t.data_ptr(), t.numel() * t.element_size())):
        t.zero_()
    return t


def warm_heap(like: Iterable[torch.Tensor]) -> int:
    """Fault in a block the size of each CPU tensor in `like` and free it; returns the bytes.

    Where the allocator keeps freed blocks (`allocator.is_tuned()`), they stay
    in this thread's heap, resident, and the gradients of the first backward
    run on this thread take them instead of faulting fresh pages in; elsewhere
    they would be unmapped at once, so nothing is done.
    """
    if not is_tuned():
        return 0
    blocks = [_faulted_in(tuple(t.shape), t.dtype) for t in like if t.device.type == "cpu"]
    return sum(b.numel() * b.element_size() for b in blocks)


def _swappable(t: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `t` alone owns its storage, so trading it for `b`'s leaves nobody else's view behind."""
    return (
        t.shape == b.shape
        and t.dtype == b.dtype
        and t.device == b.device
        and t._base is None
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


# Background copies of a commit hold off from a reset's start (a restore, a graceful interrupt's keep_live)
# until its sync has returned: run beside the ring's re-forming, the survivors' re-copy of their commit
# (1.2 GB each at 100M + Adam) made a failure's reset round grow with the model (0.09-0.10 s at 100M
# against 0.04 s with the copy started after it). A wait() on a held copy lets it go at once.
_gate = threading.Condition()
_resetting = False


def hold_background_copies() -> None:
    """A reset begins: commit copies started from now wait until `release_background_copies()`."""
    global _resetting
    with _gate:
        _resetting = True


def release_background_copies() -> None:
    """The reset's sync returned: held commit copies go on."""
    global _resetting
    with _gate:
        _resetting = False
        _gate.notify_all()


def _wait_for_release(hurry: threading.Event) -> None:
    with _gate:
        _gate.wait_for(lambda: not _resetting or hurry.is_set())


class _TensorBuffers:
    """Buffers that mirror a list of tensors: allocated once and reused, refilled in the background after a restore.

    `guarded[i]` says that tensor i changes only through an optimizer step,
    which calls `touched()` first: such a tensor is restored by trading
    storages with its buffer and re-copied on a background thread.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.untouched = False  # the guarded live tensors still equal the buffers' commit (no step since)
        # by index, of the last trade: (the live tensor, weakly; its data_ptr; the buffer's data_ptr). While
        # all three still hold, the pair is still swappable: the restore of a 300M model + Adam (2,288
        # tensors) checks _swappable's seven properties no more. Nothing held: a stale entry keeps no memory.
        self._traded: dict[int, tuple[weakref.ref, int, int]] = {}
        self._copier: threading.Thread | None = None
        self._hurry = threading.Event()  # set: the running copy is waited for, it must not hold back
        self._copy_error: BaseException | None = None

    def _fit(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(self.buffers) != len(tensors) or any(
            b.shape != t.shape or b.dtype != t.dtype or b.device != t.device
            for b, t in zip(self.buffers, tensors, strict=True)
        ):
            self.buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
            self._traded.clear()

    def save(self, tensors: Sequence[torch.Tensor]) -> None:
        self.wait()
        self._fit(tensors)
        with torch.no_grad():
            for b, t in zip(self.buffers, tensors, strict=True):
                b.copy_(t)
        self.untouched = True

    def save_later(self, tensors: Sequence[torch.Tensor], guarded: Sequence[bool]) -> None:
        """Like `save`, but the guarded tensors are copied on a background thread."""
        self.wait()
        self._fit(tensors)
        later = []
        with torch.no_grad():
            for b, t, g in zip(self.buffers, tensors, guarded, strict=True):
                if g:
                    later.append((b, t.detach()))  # the storage `t` holds now, whatever `t` holds later
                else:
                    b.copy_(t)
        self.untouched = True
        self._copy_in_background(later)

    def restore(self, tensors: Sequence[torch.Tensor], guarded: Sequence[bool]) -> None:
        self.wait()
        later = []
        traded = self._traded
        with torch.no_grad():
            for i, (t, g) in enumerate(zip(tensors, guarded, strict=True)):
                b = self.buffers[i]
                if g and self.untouched:
                    continue  # no step since the commit: the live tensor is the commit
                last = traded.get(i)
                if g and (
                    (last is not None and last[0]() is t and last[1] == t.data_ptr() and last[2] == b.data_ptr())  # type: ignore[union-attr]  # `is t` narrows t to the weakref's Optional
                    or _swappable(t, b)
                ):
                    old = t.data
                    t.data = b
                    self.buffers[i] = old
                    traded[i] = (weakref.ref(t), b.data_ptr(), old.data_ptr())
                    # re-copied from the commit's storage itself (b), not from `t`: whatever the user points
                    # `t` at before the copy runs, the buffer gets the commit
                    later.append((old, b))
                else:
                    t.copy_(b)
        self.untouched = True
        self._copy_in_background(later)

    def touched(self) -> None:
        self.wait()
        self.untouched = False

    def wait(self) -> None:
        """Block until a background copy finished."""
        copier, self._copier = self._copier, None
        if copier is not None:
            with _gate:  # a copy held back for a reset is needed now
                self._hurry.set()
                _gate.notify_all()
            copier.join()
        error, self._copy_error = self._copy_error, None
        if error is not None:
            raise RuntimeError(f"copying the commit in the background failed: {error}") from error

    def _copy_in_background(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return

        hurry = self._hurry = threading.Event()

        def copy_all() -> None:
            _wait_for_release(hurry)
            try:
                with torch.no_grad():
                    for b, t in pairs:
                        wait_while_transferring()  # a sync's transfer first (a newcomer's page faults)
                        b.copy_(t)
            except BaseException as e:  # noqa: BLE001 - surfaced by wait(), in the training thread
                self._copy_error = e

        self._copier = threading.Thread(target=copy_all, name="ray_elastic-commit-copy", daemon=True)
        self._copier.start()

    def copies(self) -> list[torch.Tensor]:
        # the buffers are overwritten in place by the next save: a checkpoint needs its own copy
        self.wait()
        return [b.clone() for b in self.buffers]


class ModuleHandler(StateHandler):
    """A `torch.nn.Module`: its parameters and buffers, by identity."""

    def __init__(self, value: torch.nn.Module) -> None:
        super().__init__(value)
        self._saved = _TensorBuffers()
        self._stepped: set[int] = set()

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.value.parameters()) + list(self.value.buffers())

    def _guarded(self, tensors: list[torch.Tensor]) -> list[bool]:
        return [id(t) in self._stepped for t in tensors]

    def guard(self, stepped: set[int]) -> None:
        self._stepped = stepped

    def save(self) -> None:
        self._saved.save(self._tensors())

    def restore(self) -> None:
        tensors = self._tensors()
        self._saved.restore(tensors, self._guarded(tensors))

    def touched(self) -> None:
        self._saved.touched()

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> None:
        return None

    def tensors(self) -> list[torch.Tensor]:
        return self._tensors()

    def keep_live(self) -> None:
        tensors = self._tensors()
        self._saved.save_later(tensors, self._guarded(tensors))

    def snapshot(self) -> list[torch.Tensor]:
        return self._saved.copies()

    def load_snapshot(self, snapshot: list[torch.Tensor]) -> None:
        tensors = self._tensors()
        shapes = [tuple(t.shape) for t in tensors]
        if [tuple(t.shape) for t in snapshot] != shapes:
            raise ValueError(
                f"the checkpoint's module has tensor shapes {[tuple(t.shape) for t in snapshot]}, "
                f"this model has {shapes}"
            )
        self._saved.wait()
        self._saved.buffers = [t.to(dtype=ref.dtype) for t, ref in zip(snapshot, tensors, strict=True)]
        self._saved.untouched = False
        self.restore()


def _inner_optimizer(value: Any) -> torch.optim.Optimizer:
    """The optimizer whose step changes the state: the wrapped one inside a `DistributedOptimizer`."""
    return value.optimizer if isinstance(value, DistributedOptimizer) else value


class OptimizerHandler(StateHandler):
    """An optimizer's per-parameter state and its param groups' hyper-parameters."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._buffers = _TensorBuffers()
        self._layout: list[tuple[int, str]] = []  # (param index, state key) of each saved tensor
        self._values: dict[tuple[int, str], Any] = {}  # non-tensor state (e.g. a float step)
        self._hyper: list[dict[str, Any]] = []
        self._stepped = False  # a step pre-hook tells this handler before the optimizer changes its state
        self._shapes: tuple[tuple[int, str, tuple[int, ...], torch.dtype], ...] = ()  # the saved tensors' layout
        self._prepared: dict[tuple[int, str], torch.Tensor] = {}  # see prepare

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return _inner_optimizer(self.value)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _state_items(
        self, ordered: bool = False
    ) -> tuple[list[tuple[int, str]], list[torch.Tensor], dict[tuple[int, str], Any]]:
        """Tensor state (layout and tensors) and the other values: in the optimizer's order, or by key."""
        layout, tensors, values = [], [], {}
        for i, p in enumerate(self._params()):
            items = self.optimizer.state.get(p, {}).items()
            for key, v in sorted(items) if ordered else items:
                if isinstance(v, torch.Tensor):
                    layout.append((i, key))
                    tensors.append(v)
                else:
                    values[(i, key)] = v
        return layout, tensors, values

    def _hyper_params(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def guard(self, stepped: set[int]) -> None:
        self._stepped = True

    def touched(self) -> None:
        self._buffers.touched()

    def save(self) -> None:
        self._save(later=False)

    def keep_live(self) -> None:
        self._save(later=True)

    def _save(self, later: bool) -> None:
        layout, tensors, values = self._state_items()
        if later:
            self._buffers.save_later(tensors, [self._stepped] * len(tensors))
        else:
            self._buffers.save(tensors)
        self._layout = layout
        self._shapes = tuple((i, key, tuple(t.shape), t.dtype) for (i, key), t in zip(layout, tensors, strict=True))
        self._values = copy.deepcopy(values)
        self._hyper = copy.deepcopy(self._hyper_params())

    def layout(self) -> tuple[tuple[int, str, tuple[int, ...], torch.dtype], ...]:
        """(param index, key, shape, dtype) of each tensor of the last commit: what a newcomer will receive."""
        return self._shapes

    def prepare(self, layout: Sequence[tuple[int, str, tuple[int, ...], torch.dtype]]) -> int:
        """Allocate the tensors `layout` names, their pages faulted in, for `receive` to use; returns the bytes.

        A newcomer calls it with rank 0's published layout before it tells
        the driver it is ready, so the first touch of that fresh memory (on a VM about
        as costly as receiving its bytes) is off the sync's path. Kept apart
        from the optimizer's state until `receive` takes them: an optimizer
        that ends up receiving nothing is left as it was. The buffers of the
        commit the newcomer makes of what it received are allocated and
        faulted in too: their first touch would otherwise fall in its first
        training step, while the survivors wait on its gradients.
        """
        params = self._params()
        if any(i >= len(params) or params[i].device.type != "cpu" for i, _, _, _ in layout):
            return 0  # not this optimizer's layout, or state on a GPU: nothing to gain on the host
        made = []
        for i, key, shape, dtype in layout:
            self._prepared[(i, key)] = _faulted_in(shape, dtype)
            made.append(self._prepared[(i, key)])
        self._buffers.wait()
        if not self._buffers.buffers:  # the commit of what it receives keeps this layout's order (receive)
            self._buffers.buffers = [_faulted_in(shape, dtype) for _, _, shape, dtype in layout]
            made.extend(self._buffers.buffers)
        return sum(t.numel() * t.element_size() for t in made)

    def restore(self) -> None:
        params = self._params()
        state = self.optimizer.state
        if not (self._stepped and self._buffers.untouched):
            saved_params = {i for i, _ in self._layout} | {i for i, _ in self._values}
            for i, p in enumerate(params):
                if i not in saved_params:
                    state.pop(p, None)  # state created after the commit did not exist then
            live = []
            for (i, key), buf in zip(self._layout, self._buffers.buffers, strict=True):
                st = state.setdefault(params[i], {})
                current = st.get(key)
                if not (
                    isinstance(current, torch.Tensor)
                    and current.shape == buf.shape
                    and current.dtype == buf.dtype
                    and current.device == buf.device
                ):
                    current = st[key] = torch.empty_like(buf)
                live.append(current)
            self._buffers.restore(live, [self._stepped] * len(live))
            for (i, key), v in self._values.items():
                state.setdefault(params[i], {})[key] = copy.deepcopy(v)
            saved_keys = set(self._layout) | set(self._values)
            for i, p in enumerate(params):
                for key in [k for k in state.get(p, {}) if (i, k) not in saved_keys]:
                    del state[p][key]
        for group, hyper in zip(self.optimizer.param_groups, self._hyper, strict=True):
            group.update(copy.deepcopy(hyper))

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> dict[str, Any]:
        layout, tensors, values = self._state_items()
        return {
            "tensors": [(i, key, tuple(t.shape), t.dtype) for (i, key), t in zip(layout, tensors, strict=True)],
            "values": values,
            "hyper": self._hyper_params(),
        }

    def receive(self, skeleton: dict[str, Any]) -> None:
        params = self._params()
        state = self.optimizer.state
        wanted = {(i, key) for i, key, _, _ in skeleton["tensors"]} | set(skeleton["values"])
        for i, p in enumerate(params):
            for key in [k for k in state.get(p, {}) if (i, k) not in wanted]:
                del state[p][key]
            if p in state and not state[p]:
                del state[p]
        for i, key, shape, dtype in skeleton["tensors"]:
            st = state.setdefault(params[i], {})
            current = st.get(key)
            if not (isinstance(current, torch.Tensor) and tuple(current.shape) == shape and current.dtype == dtype):
                ready = self._prepared.pop((i, key), None)
                if ready is not None and tuple(ready.shape) == shape and ready.dtype == dtype:
                    st[key] = ready  # allocated and faulted in while this newcomer waited (see prepare)
                else:
                    # on the parameter's device: a newcomer's state must sit where rank 0's does (a GPU)
                    st[key] = torch.empty(shape, dtype=dtype, device=params[i].device)
        for (i, key), v in skeleton["values"].items():
            state.setdefault(params[i], {})[key] = v
        for group, hyper in zip(self.optimizer.param_groups, skeleton["hyper"], strict=True):
            group.update(hyper)

    def after_sync(self) -> None:
        self._prepared.clear()  # what a sync did not take

    def tensors(self) -> list[torch.Tensor]:
        # by key: the same order on every rank, whatever order each rank's optimizer created its state in
        return self._state_items(ordered=True)[1]

    def snapshot(self) -> dict[str, Any]:
        # save() replaces layout, values and hyper-parameters; only the tensor buffers are reused
        return {"layout": self._layout, "tensors": self._buffers.copies(), "values": self._values, "hyper": self._hyper}

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        if len(snapshot["hyper"]) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(snapshot['hyper'])} param groups, "
                f"this one has {len(self.optimizer.param_groups)}"
            )
        count = len(self._params())
        if any(i >= count for i, _ in list(snapshot["layout"]) + list(snapshot["values"])):
            raise ValueError(f"the checkpoint's optimizer state covers more than this optimizer's {count} parameters")
        self._buffers.wait()
        self._layout = list(snapshot["layout"])
        self._buffers.buffers = list(snapshot["tensors"])
        self._buffers.untouched = False
        self._values = snapshot["values"]
        self._hyper = snapshot["hyper"]
        self.restore()


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0) -> None:
    """Copy `root_rank`'s optimizer state and hyper-parameters to every rank, as Horovod's helper does."""
    if root_rank != 0:
        raise ValueError("broadcast_optimizer_state broadcasts from rank 0, the oldest survivor")
    OptimizerHandler(optimizer).sync()


class SamplerHandler(StateHandler):
    """An `ElasticSampler` (or a prepared loader's): the epoch and the processed-sample bitmap."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved = self.sampler.state_dict()

    @property
    def sampler(self) -> ElasticSampler:
        """The sampler itself, or the one inside a `prepare_data_loader` loader (the state's value)."""
        return self.value if isinstance(self.value, ElasticSampler) else self.value.sampler

    def prepare_save(self) -> None:
        # record_indices() marks only this rank's samples: OR the bitmaps so every rank holds all.
        # Agree first, so no rank enters the union alone (TorchState's first commit skips this).
        self.sampler.record_pending()  # a prepared loader's batch trained since it was handed out
        ctx = maybe_current()
        ring = ctx.group if ctx is not None else None
        if ring is not None and ring.max_int(int(self.sampler.needs_union)):
            ring.bitwise_or_(self.sampler.bitmap)
            self.sampler.needs_union = False

    def save(self) -> None:
        self._saved = self.sampler.state_dict()

    def restore(self) -> None:
        self.sampler.load_state_dict(self._saved)

    def snapshot(self) -> dict[str, Any]:
        return self._saved  # state_dict() copies the bitmap, and save() replaces the dict

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        n = self.sampler.state_dict()["n"]
        if snapshot.get("n") != n:
            raise ValueError(f"the checkpoint's sampler covers {snapshot.get('n')} samples, this one {n}")
        self._saved = snapshot
        self.restore()

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in self.sampler.state_dict().items() if k != "bitmap"}

    def receive(self, meta: dict[str, Any]) -> None:
        state = self.sampler.state_dict()
        state.update(meta)
        if state["bitmap"].size != (meta["n"] + 7) // 8:
            state["bitmap"] = np.zeros((meta["n"] + 7) // 8, dtype=np.uint8)
        self.sampler.load_state_dict(state)

    def tensors(self) -> list[torch.Tensor]:
        return [torch.from_numpy(self.sampler.bitmap)]  # the live bitmap: received in place

    def after_sync(self) -> None:
        ring = current_ring()
        self.sampler.set_world(ring.rank, ring.size)


class ObjectHandler(CopiedHandler):
    """Any picklable value: deep copies; a sync hands rank 0's to the ranks that need it."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved = copy.deepcopy(value)

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value)

    def restore(self) -> None:
        self.value = copy.deepcopy(self._saved)

    def sync(self) -> None:
        _sync_from_rank0(self)

    def describe(self) -> Any:
        return self.value

    def receive(self, description: Any) -> None:
        self.value = description


_REGISTRY: list[tuple[type, Callable[[Any], StateHandler]]] = []


def register_handler(value_type: type, factory: Callable[[Any], StateHandler]) -> None:
    """Use `factory(value)` for attributes of `value_type` (newest registration wins)."""
    _REGISTRY.insert(0, (value_type, factory))


def _handler_for(value: Any) -> StateHandler:
    for value_type, factory in _REGISTRY:
        if isinstance(value, value_type):
            return factory(value)
    if isinstance(value, torch.nn.Module):
        return ModuleHandler(value)
    if isinstance(value, torch.optim.Optimizer):  # a DistributedOptimizer too
        return OptimizerHandler(value)
    if isinstance(value, (ElasticSampler, ElasticDataLoader)):  # a loader: its sampler's position, the loader kept
        return SamplerHandler(value)
    if saves_itself(value):  # a scheduler, a GradScaler, an EMA: restored in place, never replaced by a copy
        return StateDictHandler(value)
    return ObjectHandler(value)


class TorchState(State):
    """State of a PyTorch training loop: `TorchState(model=m, optimizer=o, sampler=s, scheduler=sc, epoch=0)`.

    Anything with `state_dict()`/`load_state_dict()` (an LR scheduler, a
    `GradScaler`, an EMA) is restored in place: the object the loop holds is
    the one that rolls back. `rng=True` adds the global random generators.

    Attributes read and write through to their handlers, so `state.epoch = 3`
    is what the next `commit()` saves. `last_sync` says what the last sync
    moved (a `SyncReport`).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        values = dict(kwargs)
        if values.get("rng") is True:  # the global generators roll back with the state (see `RngState`)
            values["rng"] = RngState()
        if model is not None:
            values["model"] = model
        if optimizer is not None:
            values["optimizer"] = optimizer
        object.__setattr__(self, "_handlers", {k: _handler_for(v) for k, v in values.items()})
        object.__setattr__(self, "_hooked", {})  # id(optimizer) -> (optimizer, its step pre-hook's handle)
        # where rank 0 publishes its optimizers' layout for newcomers: states are built in the same order everywhere
        object.__setattr__(self, "_layout_key", f"torch_state_layout/{next(_state_numbers)}")
        object.__setattr__(self, "_published", None)
        super().__init__()
        # no collective in this first commit: a newcomer of a Horovod script is already in the ring when it
        # builds its state, while the survivors wait in their sync's agreement (the two would never meet);
        # the sync right after gives every rank rank 0's state
        self._save(later=False, collectives=False)
        ctx = maybe_current()
        if ctx is not None:
            ctx.add_join_preparation(self._prepare_newcomer)

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
        hold_background_copies()
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
        self._publish_layout()

    def _publish_layout(self) -> None:
        """On rank 0: put its optimizers' state layout in the run's KV when it changed (a few KB, not awaited)."""
        ctx = maybe_current()
        if ctx is None or ctx.group is None or ctx.group.rank != 0:
            return
        layouts = {n: h.layout() for n, h in self._handlers.items() if isinstance(h, OptimizerHandler) and h.layout()}
        if layouts and layouts != self._published:
            ctx.post_lasting(self._layout_key, pickle.dumps(layouts))
            object.__setattr__(self, "_published", layouts)

    def _prepare_newcomer(self) -> None:
        """Before this worker first says it is ready: allocate and fault in what rank 0's commit will send."""
        ctx = maybe_current()
        raw = None if ctx is None else ctx.get_lasting(self._layout_key)
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
        hold_background_copies()
        for handler in self._handlers.values():
            handler.restore()

    def sync(self) -> None:
        """Rank 0's commit on every rank, moving state only to the ranks that do not hold it."""
        try:
            self._sync()
        finally:
            release_background_copies()

    def _sync(self) -> None:
        started = time.perf_counter()
        ring = current_ring()
        plan = agree(ring, self.commit_id)
        agreed = time.perf_counter() - started
        received = 0
        if plan.moves_state:
            received = self._transfer(ring, plan)
            # every rank's receive done before any rank's held commit copy starts: a holder's copy (1.2 GB at
            # 100M + Adam) beside a newcomer's last receives slowed that newcomer's sync by a third
            ring.max_int(0)
        for handler in self._handlers.values():
            handler.after_sync()
        self.last_sync = SyncReport(plan.holders, plan.receivers, received, time.perf_counter() - started, agreed)

    def _transfer(self, ring: CollectiveGroup, plan: SyncPlan) -> int:
        moving = {name: h for name, h in self._handlers.items() if _moves_only_what_is_needed(h)}
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
            if name not in moving:  # a user handler with only sync(): its own broadcast, on every rank
                handler.sync()
                handler.save()
        if plan.receives:
            # the commit of what it received is copied after the sync, as the holders' are: a copy running
            # beside the sync's last allreduce made a 10M newcomer's sync 15-25% longer on 2 cores
            hold_background_copies()
            for handler in moving.values():
                handler.received()
            self.commit_id = commit_id
        self._guard()
        return received

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
