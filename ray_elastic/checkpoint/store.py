"""The checkpoint directory: the newest `keep` checkpoints, each complete before it counts.

`checkpoint_dir` (a local path or an fsspec URL: `file://`, `s3://`, `gs://`
... with the matching fsspec package installed) holds one directory per
checkpoint, numbered in the order they were written:

    checkpoint_dir/
      checkpoint_000007/
        model.pt  optimizer.pt  sampler.pt  values.json  ray_elastic.json
      checkpoint_000008/
        ...

`ray_elastic.json` (commit number, generation, world size, time, library
version, and which file holds which attribute) is written last, in one
piece: a checkpoint without it is torn (a crash or a storage error in the
middle of its write) and is never read, so the previous one stays the
latest. That needs no rename of a directory, which object stores do not
have: on them a single PUT of the small file is what makes a checkpoint
whole. Each write removes the torn ones and all but the newest `keep`.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from typing import Any

from ray_elastic.checkpoint import files as plain_files
from ray_elastic.checkpoint.bounded import CheckpointError

META_FILE = "ray_elastic.json"
FORMAT = 2
OLD_FILE = "ray_elastic_checkpoint.pkl"  # format 1: one pickle of the handlers' snapshots, no longer read
_NAME = re.compile(r"^checkpoint_(\d+)$")


def normalize_url(url: str | os.PathLike) -> str:
    """Local paths become absolute (workers' working directories differ); URLs stay as given."""
    text = os.fspath(url)
    return text if "://" in text else os.path.abspath(os.path.expanduser(text))


def library_version() -> str:
    """The installed ray-elastic's version, for the checkpoint's meta (read from the package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ray-elastic")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class CheckpointStore:
    """The checkpoints in `url` (a local directory or an fsspec URL); writes keep the newest `keep`."""

    def __init__(self, url: str, keep: int = 2) -> None:
        import fsspec

        self.url = url
        self.keep = keep
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise CheckpointError(f"checkpoint_dir={url!r}: fsspec cannot open it: {e}") from e
        self.root = root.rstrip("/") or "/"

    def check_writable(self) -> None:
        """Create the directory and prove a file can be written and removed there."""
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            probe = f"{self.root}/.probe-{uuid.uuid4().hex}"
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except Exception as e:  # noqa: BLE001 - any storage error means the same thing to the user
            raise CheckpointError(f"checkpoint_dir={self.url!r} is not writable: {type(e).__name__}: {e}") from e

    def refuse_old_format(self) -> None:
        """Refuse a directory whose only checkpoint is in format 1: a run would silently start over."""
        if self.fs.exists(f"{self.root}/{OLD_FILE}") and not self.checkpoints():
            raise CheckpointError(
                f"checkpoint_dir={self.url!r} holds a checkpoint in the format of earlier ray-elastic releases "
                f"({OLD_FILE}), which this release does not read: resuming from it would silently start over. "
                "Finish that run with the release that wrote it, or move the file away to start afresh"
            )

    def _numbered(self) -> list[tuple[int, str]]:
        """Every checkpoint directory, torn ones included, as (number, path), oldest first."""
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for path in names:
            match = _NAME.match(path.rstrip("/").rsplit("/", 1)[-1])
            if match:
                found.append((int(match.group(1)), path.rstrip("/")))
        return sorted(found)

    def _complete(self, path: str) -> bool:
        return bool(self.fs.exists(f"{path}/{META_FILE}"))

    def checkpoints(self) -> list[str]:
        """The complete checkpoints' paths, oldest first."""
        return [path for _, path in self._numbered() if self._complete(path)]

    def latest(self) -> str | None:
        """The newest complete checkpoint's path (in the store's filesystem), or None."""
        for _, path in reversed(self._numbered()):
            if self._complete(path):
                return path
        return None

    def exists(self) -> bool:
        return self.latest() is not None

    def write(self, entries: dict[str, Any], meta: dict[str, Any]) -> str:
        """Write `entries` (name -> plain value) as the newest checkpoint, with `meta`; returns its path.

        The files first, `ray_elastic.json` last: until it exists the
        checkpoint does not count. A write that fails leaves no directory
        behind if it can, and the previous checkpoint is the latest either way.
        """
        self.fs.makedirs(self.root, exist_ok=True)
        numbered = self._numbered()
        number = numbered[-1][0] + 1 if numbered else 1
        path = f"{self.root}/checkpoint_{number:06d}"
        try:
            self.fs.makedirs(path, exist_ok=True)
            names = plain_files.write_entries(self.fs, path, entries)
            record = {
                "format": FORMAT,
                **meta,
                "written_at": time.time(),
                "ray_elastic_version": library_version(),
                "files": names,
            }
            self._put_whole(f"{path}/{META_FILE}", json.dumps(record, indent=1, default=str).encode())
        except BaseException:
            self._remove(path)
            raise
        self._prune(keep_from=number)
        return path

    def adopt(self, local_dir: str) -> str:
        """Copy the checkpoint in `local_dir` (a local directory, e.g. Tune's copy) in as the newest; its path."""
        import pathlib

        source = pathlib.Path(local_dir)
        if not (source / META_FILE).exists():
            raise CheckpointError(f"{local_dir!r} is not a ray-elastic checkpoint (no {META_FILE})")
        self.fs.makedirs(self.root, exist_ok=True)
        numbered = self._numbered()
        path = f"{self.root}/checkpoint_{(numbered[-1][0] + 1 if numbered else 1):06d}"
        self.fs.makedirs(path, exist_ok=True)
        for f in sorted(source.iterdir()):
            if f.is_file() and f.name != META_FILE:
                with self.fs.open(f"{path}/{f.name}", "wb") as out:
                    out.write(f.read_bytes())
        self._put_whole(f"{path}/{META_FILE}", (source / META_FILE).read_bytes())
        return path

    def _put_whole(self, path: str, data: bytes) -> None:
        """Write `data` so that a reader sees all of it or no file (a local rename; one PUT on object stores)."""
        tmp = f"{path.rsplit('/', 1)[0]}/.{uuid.uuid4().hex}.tmp"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def _remove(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except Exception:  # noqa: BLE001 - storage that failed the write may fail this too: the write's error wins
            pass

    def _prune(self, keep_from: int) -> None:
        """Remove torn checkpoints older than `keep_from` and all but the newest `keep` complete ones."""
        complete = []
        for number, path in reversed(self._numbered()):
            if number > keep_from:
                continue
            if self._complete(path):
                complete.append(path)
                if len(complete) <= self.keep:
                    continue
            self._remove(path)

    def read(self, path: str | None = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """`(entries, meta)` of the checkpoint at `path` (default: the latest), or None if there is none."""
        path = path or self.latest()
        if path is None:
            return None
        meta = self._meta_of(path)
        try:
            entries = plain_files.read_entries(self.fs, path, meta["files"])
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read the checkpoint {path!r}: {type(e).__name__}: {e}") from e
        return entries, meta

    def _meta_of(self, path: str) -> dict[str, Any]:
        try:
            with self.fs.open(f"{path}/{META_FILE}", "rb") as f:
                meta = json.loads(f.read())
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read {path}/{META_FILE}: {type(e).__name__}: {e}") from e
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
            raise CheckpointError(f"{path!r} is not a ray-elastic checkpoint of format {FORMAT}")
        return meta

    def meta(self) -> dict[str, Any] | None:
        """The latest checkpoint's meta (commit, generation, world size, time), without loading its state."""
        path = self.latest()
        return None if path is None else self._meta_of(path)

    def is_local(self) -> bool:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return protocol in ("file", "local")

    def url_of(self, path: str) -> str:
        """`path` (of this store's filesystem) as a local path or a URL that opens it from anywhere."""
        return path if self.is_local() else self.fs.unstrip_protocol(path)
