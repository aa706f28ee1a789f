"""One checkpoint's entries as plain files, and back: what a user opens without ray-elastic.

An entry is one attribute of the committed state in plain form (a model's
`state_dict()`, an optimizer's, a counter). Each goes where a user expects it:

- `<name>.pt`: an entry holding tensors, or a torch object's `state_dict()`
  (a scheduler's, a `GradScaler`'s: `Entries.torch_names`), written with
  `torch.save`, made of tensors, numbers, strings, lists, tuples and dicts
  only (checked by exact type; numpy scalars saved as Python numbers), so
  that plain `torch.load(path)` (whose default is `weights_only=True`)
  reads it; an entry that holds anything else is pickled instead;
- `values.json`: every entry that JSON keeps exactly (counters, strings,
  lists of numbers), together in one file;
- `<name>.pkl`: anything else (a numpy array, a user's class), pickled,
  and unpickled only when the reader allows it (unpickling runs code).

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


class _Unsafe(Exception):
    """A value `torch.load(weights_only=True)` cannot read back: its entry is pickled instead."""


_NUMPY_TO_PLAIN = ("bool_", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                   "float16", "float32", "float64", "complex64", "complex128")


def _weights_only_form(value: Any) -> Any:
    """`value` as `torch.load(weights_only=True)` reads it back, or `_Unsafe`.

    Checked by exact type: a subclass of a safe type (an `IntEnum`, a
    namedtuple, a `defaultdict`, an `OrderedDict` subclass, `np.float64`)
    is pickled under its own class name, which torch's safe unpickler
    refuses. Numpy scalars become the Python number of the same value (an
    LR from `np.logspace` stays in `optimizer.pt`); anything else that is
    not plain raises, and the entry goes to the pickled ones.
    """
    kind = type(value)
    if kind is bytes and not value:
        raise _Unsafe  # protocol 2 pickles b"" as a call of `bytes`, which the safe unpickler refuses
    if kind in _PLAIN or kind in (bytes, bytearray, complex):
        return value
    torch = _torch()
    if torch is not None:
        if kind in (torch.Tensor, torch.nn.Parameter):
            if value.__dict__:  # attributes set on a tensor are pickled with it
                raise _Unsafe
            return value
        if kind in (torch.dtype, torch.Size, torch.device):
            return value
    if kind.__module__ == "numpy" and kind.__name__ in _NUMPY_TO_PLAIN:
        return value.item()
    if kind in (dict, OrderedDict):
        return kind((_key(k), _weights_only_form(v)) for k, v in value.items())
    if kind in (list, tuple):
        return kind(_weights_only_form(v) for v in value)
    if kind is set:
        return {_weights_only_form(v) for v in value}
    raise _Unsafe


def _key(key: Any) -> Any:
    if type(key) not in (str, int):
        raise _Unsafe
    return key


def _weights_only(value: Any) -> tuple[bool, Any]:
    """`(True, the form to save)` if a `.pt` of `value` loads with `weights_only=True`, else `(False, None)`."""
    try:
        return True, _weights_only_form(value)
    except _Unsafe:
        return False, None


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


def _plan(name: str, value: Any, torch_object: bool = False) -> tuple[str, Any]:
    """The file an entry goes to (see the module docstring), and the form written there."""
    if (torch_object or _holds_tensor(value)) and _torch() is not None:
        safe, form = _weights_only(value)
        if safe:
            return f"{name}.pt", form
    if _json_exact(value):
        return VALUES_FILE, value
    return f"{name}.pkl", value


def file_for(name: str, value: Any, torch_object: bool = False) -> str:
    """The file an entry goes to (see the module docstring)."""
    return _plan(name, value, torch_object)[0]


def check_file_names(files: Any) -> None:
    """A `ValueError` unless `files` (a manifest's entry -> file) names only files this module writes.

    A manifest comes from storage that others may write to: a file name
    with a separator or `..` would make a reader open (and, for `.pkl`,
    unpickle) a file outside the checkpoint's own directory.
    """
    if not isinstance(files, dict):
        raise ValueError("its 'files' is not a mapping of entry names to file names")
    for name, f in files.items():
        if not isinstance(name, str) or not isinstance(f, str):
            raise ValueError(f"it maps {name!r} to {f!r}: entry and file names are strings")
        if f not in (VALUES_FILE, f"{name}.pt", f"{name}.pkl") or any(c in f for c in "/\\\0"):
            raise ValueError(
                f"it names the file {f!r} for the entry {name!r}: a checkpoint's files are plain names inside "
                f"its own directory ({name}.pt, {name}.pkl or {VALUES_FILE})"
            )


def pickled(files: dict[str, str]) -> list[str]:
    """The entries a manifest's `files` stores as pickles, sorted."""
    return sorted(name for name, f in files.items() if f.endswith(".pkl"))


def write_entries(fs: Any, directory: str, entries: dict[str, Any]) -> dict[str, str]:
    """Write `entries` into `directory` (an fsspec filesystem's path); returns each entry's file name."""
    torch_names = getattr(entries, "torch_names", frozenset())
    plans = {name: _plan(name, value, name in torch_names) for name, value in entries.items()}
    files = {name: f for name, (f, _) in plans.items()}
    check_file_names(files)  # an entry named with a separator would land outside the directory
    values = {name: form for name, (f, form) in plans.items() if f == VALUES_FILE}
    for f, form in plans.values():
        if f == VALUES_FILE:
            continue
        with fs.open(f"{directory}/{f}", "wb") as out:
            if f.endswith(".pt"):
                _torch().save(form, out)
            else:
                pickle.dump(form, out, protocol=pickle.HIGHEST_PROTOCOL)
    if values:
        with fs.open(f"{directory}/{VALUES_FILE}", "wb") as out:
            out.write(json.dumps(values, indent=1).encode())
    return files


def read_entries(fs: Any, directory: str, files: dict[str, str], allow_pickle: bool = False) -> dict[str, Any]:
    """The entries `write_entries` wrote into `directory`, by the file names it returned.

    `.pkl` entries are unpickled only with `allow_pickle` (unpickling runs
    code the file names); `.pt` files are read with `weights_only=True`.
    The caller checks `files` first (`check_file_names`).
    """
    if not allow_pickle and pickled(files):
        raise PermissionError(f"the entries {pickled(files)} are pickles and allow_pickle is False")
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
