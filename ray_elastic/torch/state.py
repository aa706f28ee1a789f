"""`TorchState`: models, optimizers and samplers that survive resets.

Each attribute gets a handler chosen by its type (`register_handler` lets
users add their own types):

- `Module`: parameters and buffers;
- `Optimizer` (or a `DistributedOptimizer` around one): per-parameter state
  (momentum, Adam moments, step counts) and the param groups'
  hyper-parameters (learning rate ...);
- `ElasticSampler`: its epoch and processed-sample bitmap;
- anything else: deep copies and object broadcasts, as in `ObjectState`.

`save()` (the first half of `commit()`) copies every tensor into a buffer
allocated once and reused, so a commit costs about one tensor copy of the
state: no deepcopy, no pickling. `restore()` copies back in place, so
parameters keep their identity and the optimizer's references stay valid.
`sync()` broadcasts rank 0's tensors with tensor collectives, coalesced per
dtype, after a small object broadcast of the optimizer's structure (a
newcomer's Adam has no moments yet).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ray_elastic.collective import broadcast_object
from ray_elastic.collective import group as current_ring
from ray_elastic.runtime.process import maybe_current
from ray_elastic.state.state import State, mismatch
from ray_elastic.torch.broadcast import broadcast_tensors_
from ray_elastic.torch.optimizer import DistributedOptimizer
from ray_elastic.torch.sampler import ElasticSampler


class StateHandler:
    """How one kind of value is saved, restored and synced."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def snapshot(self) -> Any:
        """A picklable copy of what `save()` kept, for a durable checkpoint."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support durable checkpoints: implement snapshot() and load_snapshot()"
        )

    def load_snapshot(self, snapshot: Any) -> None:
        """Make `snapshot` the saved value and restore it."""
        raise NotImplementedError(
            f"{type(self).__name__} does not support durable checkpoints: implement snapshot() and load_snapshot()"
        )


class _TensorBuffers:
    """Buffers that mirror a list of tensors, allocated once and reused."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    def save(self, tensors: list[torch.Tensor]) -> None:
        if len(self.buffers) != len(tensors) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(self.buffers, tensors, strict=True)
        ):
            self.buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        with torch.no_grad():
            for b, t in zip(self.buffers, tensors, strict=True):
                b.copy_(t)

    def restore(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for t, b in zip(tensors, self.buffers, strict=True):
                t.copy_(b)

    def copies(self) -> list[torch.Tensor]:
        # the buffers are overwritten in place by the next save: a checkpoint needs its own copy
        return [b.clone() for b in self.buffers]


class ModuleHandler(StateHandler):
    """A `torch.nn.Module`: its parameters and buffers, by identity."""

    def __init__(self, value: torch.nn.Module) -> None:
        super().__init__(value)
        self._saved = _TensorBuffers()

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.value.parameters()) + list(self.value.buffers())

    def save(self) -> None:
        self._saved.save(self._tensors())

    def restore(self) -> None:
        self._saved.restore(self._tensors())

    def sync(self) -> None:
        broadcast_tensors_(self._tensors())

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
        self._saved.buffers = [t.to(dtype=ref.dtype) for t, ref in zip(snapshot, tensors, strict=True)]
        self.restore()


def _inner_optimizer(value: Any) -> torch.optim.Optimizer:
    return getattr(value, "optimizer", value) if not isinstance(value, torch.optim.Optimizer) else value


class OptimizerHandler(StateHandler):
    """An optimizer's per-parameter state and its param groups' hyper-parameters."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._buffers = _TensorBuffers()
        self._layout: list[tuple[int, str]] = []  # (param index, state key) of each saved tensor
        self._values: dict[tuple[int, str], Any] = {}  # non-tensor state (e.g. a float step)
        self._hyper: list[dict[str, Any]] = []

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return _inner_optimizer(self.value)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _state_items(self) -> tuple[list[tuple[int, str]], list[torch.Tensor], dict[tuple[int, str], Any]]:
        layout, tensors, values = [], [], {}
        for i, p in enumerate(self._params()):
            for key, v in self.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    layout.append((i, key))
                    tensors.append(v)
                else:
                    values[(i, key)] = v
        return layout, tensors, values

    def _hyper_params(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def save(self) -> None:
        layout, tensors, values = self._state_items()
        self._buffers.save(tensors)
        self._layout = layout
        self._values = copy.deepcopy(values)
        self._hyper = copy.deepcopy(self._hyper_params())

    def restore(self) -> None:
        params = self._params()
        state = self.optimizer.state
        saved_params = {i for i, _ in self._layout} | {i for i, _ in self._values}
        for i, p in enumerate(params):
            if i not in saved_params:
                state.pop(p, None)  # state created after the commit did not exist then
        for (i, key), buf in zip(self._layout, self._buffers.buffers, strict=True):
            st = state.setdefault(params[i], {})
            current = st.get(key)
            if isinstance(current, torch.Tensor) and current.shape == buf.shape and current.dtype == buf.dtype:
                with torch.no_grad():
                    current.copy_(buf)
            else:
                st[key] = buf.clone()
        for (i, key), v in self._values.items():
            state.setdefault(params[i], {})[key] = copy.deepcopy(v)
        saved_keys = set(self._layout) | set(self._values)
        for i, p in enumerate(params):
            for key in [k for k in state.get(p, {}) if (i, k) not in saved_keys]:
                del state[p][key]
        for group, hyper in zip(self.optimizer.param_groups, self._hyper, strict=True):
            group.update(copy.deepcopy(hyper))

    def sync(self) -> None:
        layout, tensors, values = self._state_items()
        skeleton = {
            "tensors": [(i, key, tuple(t.shape), t.dtype) for (i, key), t in zip(layout, tensors, strict=True)],
            "values": values,
            "hyper": self._hyper_params(),
        }
        skeleton = broadcast_object(skeleton, root_rank=0)
        params = self._params()
        state = self.optimizer.state
        wanted = {(i, key) for i, key, _, _ in skeleton["tensors"]} | set(skeleton["values"])
        for i, p in enumerate(params):
            for key in [k for k in state.get(p, {}) if (i, k) not in wanted]:
                del state[p][key]
            if p in state and not state[p]:
                del state[p]
        ordered = []
        for i, key, shape, dtype in skeleton["tensors"]:
            st = state.setdefault(params[i], {})
            current = st.get(key)
            if not (isinstance(current, torch.Tensor) and tuple(current.shape) == shape and current.dtype == dtype):
                # on the parameter's device: a newcomer's state must sit where rank 0's does (a GPU)
                current = st[key] = torch.zeros(shape, dtype=dtype, device=params[i].device)
            ordered.append(current)
        broadcast_tensors_(ordered)
        for (i, key), v in skeleton["values"].items():
            state.setdefault(params[i], {})[key] = v
        for group, hyper in zip(self.optimizer.param_groups, skeleton["hyper"], strict=True):
            group.update(hyper)

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
        self._layout = list(snapshot["layout"])
        self._buffers.buffers = list(snapshot["tensors"])
        self._values = snapshot["values"]
        self._hyper = snapshot["hyper"]
        self.restore()


def broadcast_optimizer_state(optimizer: Any, root_rank: int = 0) -> None:
    """Copy `root_rank`'s optimizer state and hyper-parameters to every rank, as Horovod's helper does."""
    if root_rank != 0:
        raise ValueError("broadcast_optimizer_state broadcasts from rank 0, the oldest survivor")
    OptimizerHandler(optimizer).sync()


class SamplerHandler(StateHandler):
    """An `ElasticSampler`: the epoch and the processed-sample bitmap."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved = value.state_dict()

    def save(self) -> None:
        # record_indices() marks only this rank's samples: OR the bitmaps so every rank holds all.
        # Agree first, so no rank enters the union alone; before the first ring (the commit in
        # TorchState's constructor) there is nobody to agree with.
        ctx = maybe_current()
        ring = ctx.group if ctx is not None else None
        if ring is not None and ring.max_int(int(self.value.needs_union)):
            ring.bitwise_or_(self.value.bitmap)
            self.value.needs_union = False
        self._saved = self.value.state_dict()

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)

    def snapshot(self) -> dict[str, Any]:
        return self._saved  # state_dict() copies the bitmap, and save() replaces the dict

    def load_snapshot(self, snapshot: dict[str, Any]) -> None:
        n = self.value.state_dict()["n"]
        if snapshot.get("n") != n:
            raise ValueError(f"the checkpoint's sampler covers {snapshot.get('n')} samples, this one {n}")
        self._saved = snapshot
        self.restore()

    def sync(self) -> None:
        state = self.value.state_dict()
        meta = broadcast_object({k: v for k, v in state.items() if k != "bitmap"}, root_rank=0)
        state.update(meta)
        if state["bitmap"].size != (meta["n"] + 7) // 8:
            state["bitmap"] = np.zeros((meta["n"] + 7) // 8, dtype=np.uint8)
        self.value.load_state_dict(state)
        ring = current_ring()
        ring.broadcast_(self.value.bitmap, 0)  # in place: the live bitmap becomes rank 0's
        self.value.set_world(ring.rank, ring.size)


class ObjectHandler(StateHandler):
    """Any picklable value: deep copies, and an object broadcast on sync."""

    def __init__(self, value: Any) -> None:
        super().__init__(value)
        self._saved = copy.deepcopy(value)

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value)

    def restore(self) -> None:
        self.value = copy.deepcopy(self._saved)

    def sync(self) -> None:
        self.value = broadcast_object(self.value, root_rank=0)

    def snapshot(self) -> Any:
        return self._saved  # save() replaces it with a fresh deep copy

    def load_snapshot(self, snapshot: Any) -> None:
        differ = mismatch(self._saved, snapshot)
        if differ is not None:
            raise ValueError(f"the checkpoint does not fit this attribute: {differ}")
        self._saved = snapshot
        self.restore()


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
    if isinstance(value, (torch.optim.Optimizer, DistributedOptimizer)):
        return OptimizerHandler(value)
    if isinstance(value, ElasticSampler):
        return SamplerHandler(value)
    return ObjectHandler(value)


class TorchState(State):
    """State of a PyTorch training loop: `TorchState(model=m, optimizer=o, sampler=s, epoch=0)`.

    Attributes read and write through to their handlers, so `state.epoch = 3`
    is what the next `commit()` saves.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        values = dict(kwargs)
        if model is not None:
            values["model"] = model
        if optimizer is not None:
            values["optimizer"] = optimizer
        object.__setattr__(self, "_handlers", {k: _handler_for(v) for k, v in values.items()})
        super().__init__()
        self.save()

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

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        self.save()

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
