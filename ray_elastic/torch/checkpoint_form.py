"""A `TorchState`'s commit as the state dicts PyTorch users know, and back.

The handlers keep a commit in the form that restores fastest (a module's
tensors by position, an optimizer's tensors by (parameter, key)); a
checkpoint holds what `model.state_dict()` and `optimizer.state_dict()`
would have returned at that commit, so `model.load_state_dict(torch.load(
"model.pt"))` works without ray-elastic. A model wrapped by
`prepare_model` or `DistributedDataParallel` is saved under the wrapped
module's names (no `module.` prefix). Every tensor in it is a host (CPU)
copy, whatever device the state trains on, so a checkpoint of a GPU run
opens on a machine without a GPU. Loading goes the other way and names
what does not fit: a missing or unexpected key, a shape that differs.
Importing this module registers the form (`ray_elastic.torch` imports it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ray_elastic.checkpoint.entries import register_form
from ray_elastic.checkpoint.files import Entries
from ray_elastic.torch.commit_buffers import host_copy
from ray_elastic.torch.module_handler import ModuleHandler
from ray_elastic.torch.optimizer_handler import OptimizerHandler
from ray_elastic.torch.sampler_handler import SamplerHandler
from ray_elastic.torch.state import TorchState


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP wrappers (whose state dicts prefix every key with `module.`)."""
    from ray_elastic.torch.ddp import ElasticDDP

    while isinstance(module, (ElasticDDP, torch.nn.parallel.DistributedDataParallel)):
        module = module.module
    return module


def _keyed(handler: ModuleHandler) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """The module's state dict keys to its live tensors, and the tensors in the handler's commit order."""
    keyed = _unwrapped(handler.value).state_dict(keep_vars=True)
    return {k: v for k, v in keyed.items() if isinstance(v, torch.Tensor)}, handler._tensors()


def module_state_dict(handler: ModuleHandler, snapshot: list[torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    keyed, tensors = _keyed(handler)
    position = {id(t): i for i, t in enumerate(tensors)}
    return OrderedDict((k, snapshot[position[id(v)]]) for k, v in keyed.items() if id(v) in position)


def module_snapshot(handler: ModuleHandler, state_dict: dict[str, Any]) -> list[torch.Tensor]:
    keyed, tensors = _keyed(handler)
    missing = sorted(set(keyed) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(keyed))
    if missing or unexpected:
        raise ValueError(f"the checkpoint's model lacks keys {missing} and has keys {unexpected} this model lacks")
    shapes = [
        f"{k}: {tuple(state_dict[k].shape)} in the checkpoint, {tuple(v.shape)} here"
        for k, v in keyed.items()
        if tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    if shapes:
        raise ValueError(f"the checkpoint's model has other tensor shapes: {'; '.join(shapes)}")
    key_of = {}
    for k, v in keyed.items():
        key_of.setdefault(id(v), k)
    # a tensor outside the state dict (a non-persistent buffer) keeps its live value
    return [state_dict[key_of[id(t)]] if id(t) in key_of else t.detach().clone() for t in tensors]


def optimizer_state_dict(handler: OptimizerHandler, snapshot: dict[str, Any]) -> dict[str, Any]:
    """`torch.optim.Optimizer.state_dict()`'s form: per-parameter state by index, groups with their indices."""
    groups, first = [], 0
    for group, hyper in zip(handler.optimizer.param_groups, snapshot["hyper"], strict=True):
        groups.append({**hyper, "params": list(range(first, first + len(group["params"])))})
        first += len(group["params"])
    state: dict[int, dict[str, Any]] = {}
    for (i, key), tensor in zip(snapshot["layout"], snapshot["tensors"], strict=True):
        state.setdefault(i, {})[key] = tensor
    for (i, key), value in snapshot["values"].items():
        state.setdefault(i, {})[key] = value
    return {"state": state, "param_groups": groups}


def optimizer_snapshot(state_dict: dict[str, Any]) -> dict[str, Any]:
    groups = state_dict.get("param_groups")
    if not isinstance(groups, list) or not isinstance(state_dict.get("state"), dict):
        raise ValueError("the checkpoint's optimizer entry is not an optimizer state_dict")
    layout, tensors, values = [], [], {}
    for i in sorted(state_dict["state"]):
        for key, value in state_dict["state"][i].items():
            if isinstance(value, torch.Tensor):
                layout.append((int(i), key))
                tensors.append(value)
            else:
                values[(int(i), key)] = value
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return {"layout": layout, "tensors": tensors, "values": values, "hyper": hyper}


def _on_host(value: Any) -> Any:
    """`value` with every device tensor in its dicts, lists and tuples replaced by a host copy."""
    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else host_copy(value)
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _on_host(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_on_host(v) for v in value)
    return value


def torch_entries(state: TorchState) -> Entries:
    """The commit of `state` as plain entries: state dicts for the torch objects, values as they are."""
    from ray_elastic.torch.state_dict_handler import StateDictHandler

    payload = state.checkpoint_payload()
    entries: dict[str, Any] = {}
    for name, handler in state._handlers.items():  # the handler decides the form of its commit
        snap = payload[name]
        if isinstance(handler, ModuleHandler):
            entries[name] = module_state_dict(handler, snap)
        elif isinstance(handler, OptimizerHandler):
            entries[name] = optimizer_state_dict(handler, snap)
        elif isinstance(handler, SamplerHandler):
            entries[name] = {**snap, "bitmap": torch.from_numpy(snap["bitmap"].copy())}
        else:  # a scheduler's, an EMA's state dict: its device tensors (an EMA's weights) copied to the host
            entries[name] = _on_host(snap)
    saves_itself = (ModuleHandler, OptimizerHandler, SamplerHandler, StateDictHandler)
    return Entries(entries, frozenset(n for n, h in state._handlers.items() if isinstance(h, saves_itself)))


def torch_payload(state: TorchState, entries: dict[str, Any]) -> dict[str, Any]:
    """`entries` (from `torch_entries`, possibly of another model) in the form `state.load_checkpoint` takes."""
    if set(entries) != set(state._handlers):
        raise ValueError(f"the checkpoint holds {sorted(entries)}, this TorchState holds {sorted(state._handlers)}")
    payload: dict[str, Any] = {}
    for name, handler in state._handlers.items():
        entry = entries[name]
        try:
            if isinstance(handler, ModuleHandler):
                payload[name] = module_snapshot(handler, entry)
            elif isinstance(handler, OptimizerHandler):
                payload[name] = optimizer_snapshot(entry)
            elif isinstance(handler, SamplerHandler):
                bitmap = entry["bitmap"]
                payload[name] = {**entry, "bitmap": np.asarray(bitmap.numpy() if hasattr(bitmap, "numpy") else bitmap)}
            else:
                payload[name] = entry
        except ValueError as e:
            raise ValueError(f"the checkpoint does not fit this TorchState's {name!r}: {e}") from e
    return payload


def load_torch_entries(state: TorchState, entries: dict[str, Any]) -> None:
    state.load_checkpoint(torch_payload(state, entries))


register_form(TorchState, torch_entries, load_torch_entries)
