"""One checkpoint's entries as plain files, and back: what a user opens without ray-elastic.

An entry is one attribute of the committed state in plain form (a model's
`state_dict()`, an optimizer's, a counter). Each goes where a user expects it:

- `<name>.pt`: an entry holding tensors, or a torch object's `state_dict()`
  (a scheduler's, a `GradScaler`'s: `Entries.torch_names`), written with
  `torch.save`, made of tensors, numbers, strings, lists, tuples and dicts
  only, so that plain `torch.load(path)` (whose default is
  `weights_only=True`) reads it;
- `values.json`: every entry that JSON keeps exactly (counters, strings,
  lists of numbers), together in one file;
- `<name>.pkl`: anything else (a numpy array, a user's class), pickled.

Torch is imported only for entries that hold tensors, so a checkpoint of an
`ObjectState` is written and read where torch is not installed.
"""

from __future__ import annotations

import json
import pickle
import sys
from collections import OrderedDict
from typing import Any

VALUES_FILE = "values.json"
_PLAIN = (str, int, float, bool, type(None))


class Entries(dict):
    """A checkpoint's entries, name -> plain value; `torch_names`: those that are torch objects' state dicts."""

    def __init__(self, values: dict[str, Any], torch_names: frozenset[str] = frozenset()) -> None:
        super().__init__(values)
        self.torch_names = torch_names


def _torch() -> Any:
    return sys.modules.get("torch")


def _holds_tensor(value: Any) -> bool:
    torch = _torch()
    if torch is None:
        return False
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _weights_only_safe(value: Any) -> bool:
    """Whether `torch.load(weights_only=True)` reads `value` back: tensors, builtins and their containers."""
    torch = _torch()
    if isinstance(value, _PLAIN) or (torch is not None and isinstance(value, (torch.Tensor, torch.dtype))):
        return True
    if isinstance(value, (dict, OrderedDict)):
        return all(isinstance(k, (str, int)) and _weights_only_safe(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_weights_only_safe(v) for v in value)
    return False


def _json_exact(value: Any) -> bool:
    """Whether JSON gives `value` back equal and of the same shape (no tuple turned list, no int key turned str)."""
    try:
        return _same(json.loads(json.dumps(value, allow_nan=False)), value)
    except (TypeError, ValueError):
        return False


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b) and not (isinstance(a, float) and isinstance(b, float)):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def file_for(name: str, value: Any, torch_object: bool = False) -> str:
    """The file an entry goes to (see the module docstring)."""
    if (torch_object or _holds_tensor(value)) and _torch() is not None and _weights_only_safe(value):
        return f"{name}.pt"
    if _json_exact(value):
        return VALUES_FILE
    return f"{name}.pkl"


def write_entries(fs: Any, directory: str, entries: dict[str, Any]) -> dict[str, str]:
    """Write `entries` into `directory` (an fsspec filesystem's path); returns each entry's file name."""
    torch_names = getattr(entries, "torch_names", frozenset())
    files = {name: file_for(name, value, name in torch_names) for name, value in entries.items()}
    values = {name: entries[name] for name, f in files.items() if f == VALUES_FILE}
    for name, f in files.items():
        if f == VALUES_FILE:
            continue
        with fs.open(f"{directory}/{f}", "wb") as out:
            if f.endswith(".pt"):
                _torch().save(entries[name], out)
            else:
                pickle.dump(entries[name], out, protocol=pickle.HIGHEST_PROTOCOL)
    if values:
        with fs.open(f"{directory}/{VALUES_FILE}", "wb") as out:
            out.write(json.dumps(values, indent=1).encode())
    return files


def read_entries(fs: Any, directory: str, files: dict[str, str]) -> dict[str, Any]:
    """The entries `write_entries` wrote into `directory`, by the file names it returned."""
    entries: dict[str, Any] = {}
    values = None
    for name, f in files.items():
        path = f"{directory}/{f}"
        if f == VALUES_FILE:
            if values is None:
                with fs.open(path, "rb") as src:
                    values = json.loads(src.read())
            entries[name] = values[name]
            continue
        with fs.open(path, "rb") as src:
            if f.endswith(".pt"):
                import torch

                entries[name] = torch.load(src, map_location="cpu", weights_only=True)
            else:
                entries[name] = pickle.load(src)
    return entries
