"""`load_checkpoint`: a checkpoint's contents as a dict, for the user (evaluation, export, fine-tuning)."""

from __future__ import annotations

import os
from typing import Any

from ray_elastic.checkpoint.bounded import CheckpointError
from ray_elastic.checkpoint.store import META_FILE, CheckpointStore, normalize_url


def load_checkpoint(source: Any, allow_pickle: bool = False) -> dict[str, Any]:
    """The attributes of a checkpoint's state, by name: torch state dicts and plain values.

    `source`: `Result.checkpoint` (a `ray.train.Checkpoint`, a Tune trial's
    too), the path or fsspec URL of one checkpoint directory, or a whole
    `checkpoint_dir` (its latest checkpoint is read). A model's entry is its
    `state_dict()`: `model.load_state_dict(load_checkpoint(c)["model"])`.

    Opening a checkpoint runs no code from it: `.pt` files are read with
    `torch.load(weights_only=True)`, `values.json` as JSON, and a checkpoint
    holding pickled entries (`.pkl`: numpy arrays, your own classes) is
    refused with a `CheckpointError` naming them, unless `allow_pickle=True`
    says you trust whoever could write it. Its manifest may name only files
    inside its own directory.
    """
    if hasattr(source, "as_directory") and hasattr(source, "path"):  # a ray.train.Checkpoint, local or remote
        with source.as_directory() as local:
            return load_checkpoint(local, allow_pickle=allow_pickle)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_checkpoint takes a path, a URL or a ray.train.Checkpoint, not {type(source).__name__}")
    store = CheckpointStore(normalize_url(source))
    if store.fs.exists(f"{store.root}/{META_FILE}"):
        path = store.root
    else:
        path = store.latest()
        if path is None:
            raise CheckpointError(f"no complete ray-elastic checkpoint in {os.fspath(source)!r}")
    entries, _ = store.read_at(path, allow_pickle=allow_pickle)
    return entries


def ray_checkpoint(url: str) -> Any:
    """The checkpoint directory at `url` (a path or an fsspec URL) as a `ray.train.Checkpoint`."""
    try:
        from ray.train import Checkpoint
    except ImportError as e:
        raise ImportError(
            f"Result.checkpoint is a ray.train.Checkpoint, which needs ray[train] or ray[tune] "
            f"(pip install 'ray[tune]==2.60.*', the 'tune' extra); the checkpoint itself is at {url} ({e})"
        ) from e
    store = CheckpointStore(url)
    if store.is_local():
        return Checkpoint.from_directory(store.root)
    import pyarrow.fs

    return Checkpoint(store.root, filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(store.fs)))
