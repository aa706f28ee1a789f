"""A state's commit as checkpoint entries (name -> plain value), and entries back into a state.

A `State` subclass gives its own `checkpoint_payload()` under the one name
`state`. A state kind with a form of its own registers it (`register_form`):
`ObjectState` its attributes as they are (`state/state.py`), `TorchState`
its state dicts (`torch/checkpoint_form.py`, registered when
`ray_elastic.torch` is imported). So this module, which the worker's runtime
uses, imports neither the state classes nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

_FORMS: list[tuple[type, Callable[[Any], dict[str, Any]], Callable[[Any, dict[str, Any]], None]]] = []


def register_form(
    state_type: type, to_entries: Callable[[Any], dict[str, Any]], load: Callable[[Any, dict[str, Any]], None]
) -> None:
    """States of `state_type` are checkpointed as `to_entries(state)` and loaded by `load(state, entries)`."""
    _FORMS.insert(0, (state_type, to_entries, load))


def _form(state: Any) -> tuple[Callable[[Any], dict[str, Any]], Callable[[Any, dict[str, Any]], None]] | None:
    for state_type, to_entries, load in _FORMS:
        if isinstance(state, state_type):
            return to_entries, load
    return None


def state_entries(state: Any) -> dict[str, Any]:
    """The last commit of `state` as entries (copies: training may go on while they are written)."""
    form = _form(state)
    if form is not None:
        return form[0](state)
    return {"state": state.checkpoint_payload()}


def load_entries(state: Any, entries: dict[str, Any]) -> None:
    """Make `entries` the last commit of `state` and restore it; a `ValueError` names what does not fit."""
    form = _form(state)
    if form is not None:
        form[1](state, entries)
    else:
        if set(entries) != {"state"}:
            raise ValueError(f"the checkpoint holds {sorted(entries)}, written from another kind of state")
        state.load_checkpoint(entries["state"])
