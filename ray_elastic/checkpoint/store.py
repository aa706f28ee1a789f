"""The checkpoint directory: the newest `keep` checkpoints, each complete before it counts.

`checkpoint_dir` (a local path or an fsspec URL: `file://`, `s3://`, `gs://`
... with the matching fsspec package installed) holds one directory per
checkpoint, named after what it holds and who wrote it:

    checkpoint_dir/
      checkpoint_r0001-g000003-c000000120-9f3a2b1c/
        model.pt  optimizer.pt  sampler.pt  values.json  ray_elastic.json
      checkpoint_r0001-g000004-c000000130-51d07e88/
        ...

(`r`: the run, counted in the order runs wrote here; `g`: the generation;
`c`: the commit; then a random token, so two writers never share a
directory even where creating one is no claim on it, as on object stores.)

`ray_elastic.json` (commit number, generation, world size, time, library
version, and which file holds which attribute) is written last, in one
piece: a checkpoint without it is torn (a crash or a storage error in the
middle of its write, or a write still going on) and is never read. That
needs no rename of a directory, which object stores do not have: on them a
single PUT of the small file is what makes a checkpoint whole.

The newest checkpoint is the one whose manifest names the newest (run,
generation, commit), never the one written last: a rank 0 cut off from the
run may land a write after its successor's. Runs are counted because a new
`fit()` that resumed from a checkpoint counts its generations from 1 again.
Each write removes all but the newest `keep` complete checkpoints and the
torn ones older than the newest complete one; a torn one newer than that is
another writer's write in progress and stays, and so does a checkpoint
pinned while it is being copied (Tune's hand-over, `pinned`). Only a missing
manifest proves a checkpoint torn: one that exists but cannot be read (a
storage timeout, a refused permission, bytes this library did not write) is
never removed, and while its name claims it may be the newest, nothing is
read in its place (`CheckpointError` naming it: state never goes backwards).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ray_elastic.checkpoint import files as plain_files
from ray_elastic.checkpoint.bounded import CheckpointError
from ray_elastic.checkpoint.pins import Pins

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

logger = logging.getLogger(__name__)

META_FILE = "ray_elastic.json"
FORMAT = 2
OLD_FILE = "ray_elastic_checkpoint.pkl"  # format 1: one pickle of the handlers' snapshots, no longer read
# earlier releases numbered the directories (checkpoint_000042); they are still read, ordered by their manifest
_NAME = re.compile(r"^checkpoint_(?:\d+|r(\d+)-g(\d+)-c(\d+)-[0-9a-f]+)$")

Key = tuple[int, int, int]  # (run, generation, commit): the order of checkpoints, newest last


class FencedWrite(CheckpointError):
    """The writer's generation is no longer current: the checkpoint must not be written."""


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


def order_key(meta: dict[str, Any]) -> Key:
    """Where a checkpoint of this manifest stands: (run, generation, commit); absent fields count as 0."""
    return (int(meta.get("run_seq", 0)), int(meta.get("generation", 0)), int(meta.get("commit", 0)))


@dataclass(frozen=True)
class _Found:
    """One checkpoint directory as listed: its manifest, if it is complete."""

    path: str
    name: str
    meta: dict[str, Any] | None
    unreadable: str | None = None  # why its manifest exists but could not be read: not torn, just unknown

    @property
    def key(self) -> tuple[Key, float, str]:
        assert self.meta is not None
        return order_key(self.meta), float(self.meta.get("written_at", 0.0)), self.name

    @property
    def name_key(self) -> Key | None:
        """The order its name claims (a torn directory has no manifest); None for the old numbered names."""
        match = _NAME.match(self.name)
        return None if match is None or match.group(1) is None else cast("Key", tuple(int(g) for g in match.groups()))


class CheckpointStore:
    """The checkpoints in `url` (a local directory or an fsspec URL); writes keep the newest `keep`.

    `clock`: this process's monotonic clock, on which a pin's time is counted (`pinned`).
    """

    def __init__(self, url: str, keep: int = 2, clock: Callable[[], float] = time.monotonic) -> None:
        import fsspec

        self.url = url
        self.keep = keep
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise CheckpointError(f"checkpoint_dir={url!r}: fsspec cannot open it: {e}") from e
        self.root = root.rstrip("/") or "/"
        self._pins = Pins(self.fs, self.root, clock)

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

    # ---- listing --------------------------------------------------------------
    def _names(self) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []

    def _found(self, names: list[str] | None = None) -> list[_Found]:
        """Every checkpoint directory, torn ones included (`meta` None)."""
        names = self._names() if names is None else names
        return [_Found(f"{self.root}/{n}", n, *self._manifest(f"{self.root}/{n}")) for n in names if _NAME.match(n)]

    def _manifest(self, path: str) -> tuple[dict[str, Any] | None, str | None]:
        """`(manifest, None)`; `(None, None)` while it has none (torn, or being written); `(None, why)` if unreadable.

        Only a missing manifest is torn by the write protocol (it is put
        whole, last): any other error (a storage timeout, a permission, a
        manifest this library did not write) says nothing of the checkpoint.
        """
        try:
            with self.fs.open(f"{path}/{META_FILE}", "rb") as f:
                meta = json.loads(f.read())
            if not isinstance(meta, dict):
                raise ValueError(f"a JSON {type(meta).__name__}, not an object")
            order_key(meta)
        except FileNotFoundError:
            return None, None
        except Exception as e:  # noqa: BLE001 - any other error: the checkpoint may be whole, so it is kept
            why = f"its {META_FILE} cannot be read ({type(e).__name__}: {e})"
            logger.warning("the checkpoint %s is neither read nor removed: %s", path, why)
            return None, why
        return meta, None

    def _complete(self, found: list[_Found] | None = None) -> list[_Found]:
        """The complete checkpoints, oldest first by their manifests' (run, generation, commit)."""
        return sorted(
            (f for f in (self._found() if found is None else found) if f.meta is not None), key=lambda f: f.key
        )

    def checkpoints(self) -> list[str]:
        """The complete checkpoints' paths, oldest first."""
        return [f.path for f in self._complete()]

    def complete(self) -> list[tuple[str, dict[str, Any]]]:
        """The complete checkpoints as `(path, manifest)`, oldest first."""
        return [(f.path, f.meta or {}) for f in self._complete()]

    def latest(self) -> str | None:
        """The newest complete checkpoint's path (in the store's filesystem), or None.

        A `CheckpointError` if a checkpoint whose manifest cannot be read may
        be newer: an older one in its place would take the run backwards.
        """
        found = self._found()
        complete = self._complete(found)
        newest = order_key(complete[-1].meta or {}) if complete else None
        for f in found:
            if f.unreadable is not None and (newest is None or f.name_key is None or f.name_key > newest):
                raise CheckpointError(
                    f"cannot tell which checkpoint in {self.url!r} is the newest: {f.path} may be, and {f.unreadable}; "
                    "nothing older is read in its place (a resume would go back in training). If the storage "
                    "error passes, it is read; if that checkpoint is damaged, move it out of the directory"
                )
        return complete[-1].path if complete else None

    def exists(self) -> bool:
        return self.latest() is not None

    # ---- writing --------------------------------------------------------------
    def _run_seq(self, found: list[_Found], run: Any) -> int:
        """The number of the run `run` among the runs that wrote here: its own if it wrote before, else the next."""
        for f in reversed(self._complete(found)):
            if f.meta is not None and f.meta.get("run") == run:
                return int(f.meta.get("run_seq", 0))
        return self._next_run_seq(found)

    @staticmethod
    def _next_run_seq(found: list[_Found]) -> int:
        """A run number after every run's here: an unreadable manifest's run counts by its directory's name."""
        seqs = [order_key(f.meta)[0] for f in found if f.meta is not None]
        seqs += [f.name_key[0] for f in found if f.unreadable is not None and f.name_key is not None]
        return max(seqs, default=-1) + 1

    def _new_path(self, key: Key) -> str:
        run_seq, generation, commit = key
        return f"{self.root}/checkpoint_r{run_seq:04d}-g{generation:06d}-c{commit:09d}-{uuid.uuid4().hex[:8]}"

    def write(
        self, entries: dict[str, Any], meta: dict[str, Any], fence: Callable[[], str | None] | None = None
    ) -> str:
        """Write `entries` (name -> plain value) as a checkpoint, with `meta`; returns its path.

        The files first, `ray_elastic.json` last: until it exists the
        checkpoint does not count. `fence()` is asked just before that, and
        a reason it gives (the writer's generation was superseded) raises
        `FencedWrite` instead. A write that fails leaves no directory behind
        if it can, and the previous checkpoint is the latest either way.
        `meta["run"]` (the run's id) places it among other runs' checkpoints.
        """
        self.fs.makedirs(self.root, exist_ok=True)
        run_seq = self._run_seq(self._found(), meta.get("run"))
        record = {"format": FORMAT, **meta, "run_seq": run_seq}
        path = self._new_path(order_key(record))
        try:
            self.fs.makedirs(path, exist_ok=True)
            record["files"] = plain_files.write_entries(self.fs, path, entries)
            record.update(written_at=time.time(), ray_elastic_version=library_version())
            reason = fence() if fence is not None else None
            if reason is not None:
                raise FencedWrite(reason)
            self._put_whole(f"{path}/{META_FILE}", json.dumps(record, indent=1, default=str).encode())
        except BaseException:
            self._remove(path)
            raise
        self._prune()
        return path

    def adopt(self, local_dir: str) -> str:
        """Copy the checkpoint in `local_dir` (a local directory, e.g. Tune's copy) in as the newest; its path."""
        import pathlib

        source = pathlib.Path(local_dir)
        if not (source / META_FILE).exists():
            raise CheckpointError(f"{local_dir!r} is not a ray-elastic checkpoint (no {META_FILE})")
        record = self._checked(local_dir, json.loads((source / META_FILE).read_bytes()))
        self.fs.makedirs(self.root, exist_ok=True)
        # newer than any checkpoint here, whichever run wrote it: the run resumes from this one
        record["run_seq"] = self._next_run_seq(self._found())
        record["run"] = f"adopted-{uuid.uuid4().hex[:8]}"
        path = self._new_path(order_key(record))
        self.fs.makedirs(path, exist_ok=True)
        for name in sorted(set(record["files"].values())):
            with self.fs.open(f"{path}/{name}", "wb") as out:
                out.write((source / name).read_bytes())
        self._put_whole(f"{path}/{META_FILE}", json.dumps(record, indent=1, default=str).encode())
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

    def _prune(self) -> None:
        """Remove all but the newest `keep` complete checkpoints, and the torn ones older than the newest.

        A torn directory whose name claims a newer (run, generation,
        commit) than the newest complete one is another writer's write in
        progress: it stays. One whose manifest exists but could not be read
        is not known to be torn: it stays. A pinned checkpoint stays while
        its pin lasts.
        """
        names = self._names()
        found = self._found(names)
        complete = self._complete(found)
        if not complete:
            return
        pinned = self._pins.active(names)
        newest = order_key(complete[-1].meta or {})
        doomed = complete[: max(len(complete) - self.keep, 0)]
        torn = [f for f in found if f.meta is None and f.unreadable is None]
        doomed += [f for f in torn if f.name_key is None or f.name_key < newest]
        for f in doomed:
            if f.name not in pinned:
                self._remove(f.path)

    def pinned(self, path: str, seconds: float) -> AbstractContextManager[None]:
        """Keep the checkpoint at `path` from being pruned, by any writer, for the block (at most `seconds`
        after a writer first sees the pin: see `pins.py`)."""
        return self._pins.hold(path.rstrip("/").rsplit("/", 1)[-1], seconds)

    def is_complete(self, path: str) -> bool:
        return self._manifest(path)[0] is not None

    # ---- reading --------------------------------------------------------------
    def read(self, path: str | None = None, allow_pickle: bool = False) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """`(entries, meta)` of the checkpoint at `path` (default: the latest), or None if there is none.

        `.pkl` entries are unpickled only with `allow_pickle` (unpickling runs
        code): only for a directory the caller trusts as its own.
        """
        path = path or self.latest()
        return None if path is None else self.read_at(path, allow_pickle)

    def read_at(self, path: str, allow_pickle: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """`(entries, meta)` of the checkpoint at `path`; `allow_pickle` as in `read`."""
        meta = self._meta_of(path)
        names = plain_files.pickled(meta["files"])
        if names and not allow_pickle:
            raise CheckpointError(
                f"the checkpoint {self.url_of(path)!r} holds the entries {names} as pickles, and unpickling runs "
                "whatever code the file names: pass allow_pickle=True only if you trust who could write it"
            )
        if names:
            self._confine(path, [meta["files"][n] for n in names])
        try:
            entries = plain_files.read_entries(self.fs, path, meta["files"], allow_pickle=allow_pickle)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read the checkpoint {path!r}: {type(e).__name__}: {e}") from e
        return entries, meta

    def _confine(self, path: str, names: list[str]) -> None:
        """On a local disk, refuse a file that resolves outside this store's directory (a symbolic link)."""
        if not self.is_local():
            return  # object stores have no links: a plain name is inside
        inside = os.path.realpath(self.root)
        for name in names:
            real = os.path.realpath(f"{path}/{name}")
            if os.path.commonpath([real, inside]) != inside:
                raise CheckpointError(
                    f"{path}/{name} resolves to {real}, outside {self.root}: a checkpoint's pickles are read "
                    "only from inside the checkpoint directory given"
                )

    def _meta_of(self, path: str) -> dict[str, Any]:
        try:
            with self.fs.open(f"{path}/{META_FILE}", "rb") as f:
                meta = json.loads(f.read())
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read {path}/{META_FILE}: {type(e).__name__}: {e}") from e
        return self._checked(path, meta)

    @staticmethod
    def _checked(path: str, meta: Any) -> dict[str, Any]:
        """`meta` if it is a manifest of this format naming only files inside its directory; else CheckpointError."""
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
            raise CheckpointError(f"{path!r} is not a ray-elastic checkpoint of format {FORMAT}")
        try:
            plain_files.check_file_names(meta["files"])
        except ValueError as e:
            raise CheckpointError(f"refusing the checkpoint {path!r}: its {META_FILE} is unsafe to follow: {e}") from e
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
