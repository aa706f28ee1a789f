"""Durable checkpoints: the committed state on disk or in object storage.

`ElasticTrainer(checkpoint_dir=..., checkpoint_every=K)` makes rank 0 write
its committed state every K commits, so a run survives what in-memory
commits cannot: every worker lost at once, or the whole cluster gone. A new
`fit()` (or the driver, after losing every worker) starts fresh workers, and
the one that becomes rank 0 loads the checkpoint before the first sync
broadcasts it to the others.

The directory is a local path or an fsspec URL (`file://`, `s3://`,
`gs://` ... with the matching fsspec package installed). One file holds the
latest checkpoint; it is written under a temporary name, then renamed over the
old one, so a reader never sees a torn file (on object stores, where a rename
is a copy, the single final PUT is what makes it atomic).

Writes happen on a background thread from a copy of the commit, so training
goes on while the bytes reach storage; a write still in flight when the next
one is due makes that one wait, and the last write is flushed before a worker
returns. A failed write is retried with back-off and then skipped with a
warning: a storage blip never fails training, and the end of the run says
whether its last checkpoint is durable.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "ray_elastic_checkpoint.pkl"
META_FILE = "ray_elastic_checkpoint.json"  # the latest checkpoint's meta, readable without loading the state
_FORMAT = 1

R = TypeVar("R")


class CheckpointError(RuntimeError):
    """A durable checkpoint could not be written or read."""


def within(timeout: float, what: str, fn: Callable[[], R]) -> R:
    """`fn()` (a storage call), waited for at most `timeout` s; past it, `CheckpointError` naming `what`.

    Storage can hang rather than fail (a dead NFS mount, a bucket behind a
    lost route); the caller must not hang with it. `fn` runs on a daemon
    thread, which is left behind if it never returns. `what` names the call
    and the option that bounds it, e.g. "reading ... (collective_timeout)".
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="ray-elastic-storage", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CheckpointError(f"{what} did not finish within {timeout:g} s")
    if error:
        raise error[0]
    return result[0]


class CheckpointStore:
    """The latest checkpoint in `url` (a local directory or an fsspec URL)."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise CheckpointError(f"checkpoint_dir={url!r}: fsspec cannot open it: {e}") from e
        self.path = f"{self.root.rstrip('/')}/{CHECKPOINT_FILE}"
        self.meta_path = f"{self.root.rstrip('/')}/{META_FILE}"

    def check_writable(self) -> None:
        """Create the directory and prove a file can be written and renamed there."""
        try:
            self.fs.makedirs(self.root, exist_ok=True)
            probe = f"{self.root.rstrip('/')}/.probe-{uuid.uuid4().hex}"
            with self.fs.open(probe, "wb") as f:
                f.write(b"ok")
            self.fs.rm(probe)
        except Exception as e:  # noqa: BLE001 - any storage error means the same thing to the user
            raise CheckpointError(f"checkpoint_dir={self.url!r} is not writable: {type(e).__name__}: {e}") from e

    def exists(self) -> bool:
        return bool(self.fs.exists(self.path))

    def write(self, state: Any, meta: dict[str, Any]) -> None:
        """Write `state` (picklable) with `meta` atomically: temporary file, then rename."""
        meta = {**meta, "written_at": time.time()}
        record = {"format": _FORMAT, "meta": meta, "state": state}
        self.fs.makedirs(self.root, exist_ok=True)
        self._replace(self.path, lambda f: pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL))
        self._replace(self.meta_path, lambda f: f.write(json.dumps(meta, default=str).encode()))

    def _replace(self, path: str, write: Any) -> None:
        """Write through a temporary file renamed over `path`."""
        tmp = f"{self.root.rstrip('/')}/.{path.rsplit('/', 1)[-1]}.tmp-{uuid.uuid4().hex}"
        try:
            with self.fs.open(tmp, "wb") as f:
                write(f)
            self.fs.mv(tmp, path)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
            raise

    def read(self) -> tuple[Any, dict[str, Any]] | None:
        """The latest checkpoint's `(state, meta)`, or None if none was written."""
        if not self.exists():
            return None
        try:
            with self.fs.open(self.path, "rb") as f:
                record = pickle.load(f)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"cannot read the checkpoint {self.path!r}: {type(e).__name__}: {e}") from e
        if not isinstance(record, dict) or record.get("format") != _FORMAT:
            raise CheckpointError(f"{self.path!r} is not a ray-elastic checkpoint of format {_FORMAT}")
        return record["state"], record["meta"]

    def meta(self) -> dict[str, Any] | None:
        """The latest checkpoint's meta (commit, generation, world size, time), without loading its state."""
        if not self.exists():
            return None
        try:
            with self.fs.open(self.meta_path, "rb") as f:
                return json.loads(f.read())
        except (FileNotFoundError, ValueError):
            got = self.read()  # a meta file lost or torn: the checkpoint itself has it
            return None if got is None else got[1]


class CheckpointWriter:
    """Rank 0's background writer: one write in flight at a time, retried, never fatal to training.

    Storage blips are common (a throttled bucket, a full disk for a moment):
    a failed write is retried `attempts` times with a doubling back-off from
    `backoff_s`, then given up with a warning while training goes on; the
    previous checkpoint stays the latest. `flush` says, at the end, whether
    the last checkpoint is durable.
    """

    def __init__(
        self,
        store: CheckpointStore,
        attempts: int = 3,
        backoff_s: float = 1.0,
        fence: Callable[[dict[str, Any]], str | None] | None = None,
    ) -> None:
        """`fence(meta)`: why this snapshot must not be written at all (its generation is stale), or None."""
        self.store = store
        self.fence = fence
        self.attempts = attempts
        self.backoff_s = backoff_s
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None  # why the newest checkpoint handed over is not durable
        self.last_written: dict[str, Any] | None = None  # the meta of the newest durable checkpoint
        self.written = 0

    def submit(self, state: Any, meta: dict[str, Any], timeout: float) -> None:
        """Hand a snapshot (already a copy) to the writer, once the previous write ended (up to `timeout` s).

        If the previous write is still running then, this snapshot is skipped with a warning.
        """
        if not self._wait(timeout):
            self.last_error = f"a write to {self.store.url!r} was still running after {timeout:g} s"
            logger.warning("skipping the checkpoint of %s: %s", meta, self.last_error)
            return
        self._thread = threading.Thread(
            target=self._write, args=(state, meta), name="ray-elastic-checkpoint", daemon=True
        )
        self._thread.start()

    def _write(self, state: Any, meta: dict[str, Any]) -> None:
        started = time.perf_counter()
        fenced = self.fence(meta) if self.fence is not None else None
        if fenced is not None:
            self.last_error = f"the checkpoint {meta} was not written: {fenced}"
            logger.warning("%s", self.last_error)
            return
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                self.store.write(state, meta)
            except Exception as e:  # noqa: BLE001 - any storage error: retried, then reported
                error = f"{type(e).__name__}: {e}"
                if attempt < self.attempts:
                    logger.warning(
                        "writing the checkpoint %s to %s failed (attempt %d of %d: %s); retrying in %g s",
                        meta,
                        self.store.url,
                        attempt,
                        self.attempts,
                        error,
                        delay,
                    )
                    time.sleep(delay)
                    delay *= 2
                    continue
                self.last_error = (
                    f"writing the checkpoint {meta} to {self.store.url!r} failed {self.attempts} times: {error}"
                )
                logger.warning(
                    "%s; training goes on, the latest durable checkpoint is %s", self.last_error, self.last_written
                )
                return
            self.written += 1
            self.last_written = meta
            self.last_error = None
            logger.info("checkpoint %s written in %.3f s", meta, time.perf_counter() - started)
            return

    def _wait(self, timeout: float) -> bool:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
            self._thread = None
        return True

    def flush(self, timeout: float) -> str | None:
        """Wait up to `timeout` s for the write in flight; None if the newest checkpoint is durable, else why not."""
        if not self._wait(timeout):
            return f"the last checkpoint write to {self.store.url!r} did not finish within {timeout:g} s"
        return self.last_error


def normalize_url(url: str | os.PathLike) -> str:
    """Local paths become absolute (workers' working directories differ); URLs stay as given."""
    text = os.fspath(url)
    return text if "://" in text else os.path.abspath(os.path.expanduser(text))
