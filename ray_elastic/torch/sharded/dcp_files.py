"""A sharded model and its optimizers to and from a DCP checkpoint (`torch.distributed.checkpoint`).

The durable form of a sharded `TorchState`: every rank writes its own rows
and rank 0 the metadata, so `dcp.load` reads it back at any world size, in
a run of any size or in one process without a process group. Both calls are
collectives of every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _state_dicts(model: torch.nn.Module, optimizers: list[Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {"model": get_model_state_dict(model)}
    for i, opt in enumerate(optimizers):
        out[f"optimizer{i}"] = get_optimizer_state_dict(model, opt)
    return out


def save(model: torch.nn.Module, optimizers: list[Any], directory: str) -> None:
    """Write `model` and `optimizers` as they are now into `directory` (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state_dicts(model, optimizers), checkpoint_id=directory)


def load(model: torch.nn.Module, optimizers: list[Any], directory: str) -> None:
    """Make `model` and `optimizers` the checkpoint in `directory`, resharded to this world (every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state_dicts = _state_dicts(model, optimizers)
    dcp.load(state_dicts, checkpoint_id=directory)
    set_model_state_dict(model, state_dicts["model"])
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(model, opt, state_dicts[f"optimizer{i}"])
