"""Rank 0's background checkpoint writer: training goes on while the bytes reach storage.

Writes happen on a background thread from a copy of the commit; a write
still in flight when the next one is due makes that one wait, and the last
write is flushed before a worker returns. A failed write is retried with
back-off and then skipped with a warning: a storage blip never fails
training, and the end of the run says whether its last checkpoint is durable.
The fence (is the writer still rank 0 of the current generation?) is asked
before every attempt and again just before the manifest that makes a
checkpoint count, so a rank 0 replaced while it backed off or wrote its
files writes none.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ray_elastic.checkpoint.store import CheckpointStore, FencedWrite

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)


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
        """`fence(meta)`: why this snapshot must not be written (a stale writer), or None; asked before each try."""
        self.store = store
        self.fence = fence
        self.attempts = attempts
        self.backoff_s = backoff_s
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None  # why the newest checkpoint handed over is not durable
        self.last_written: dict[str, Any] | None = None  # the meta of the newest durable checkpoint
        self.written = 0

    def submit(self, entries: dict[str, Any], meta: dict[str, Any], timeout: float) -> None:
        """Hand a snapshot (already a copy) to the writer, once the previous write ended (up to `timeout` s).

        If the previous write is still running then, this snapshot is skipped with a warning.
        """
        if not self._wait(timeout):
            self.last_error = f"a write to {self.store.url!r} was still running after {timeout:g} s"
            logger.warning("skipping the checkpoint of %s: %s", meta, self.last_error)
            return
        self._thread = threading.Thread(
            target=self._write, args=(entries, meta), name="ray-elastic-checkpoint", daemon=True
        )
        self._thread.start()

    def _fenced(self, meta: dict[str, Any]) -> str | None:
        return self.fence(meta) if self.fence is not None else None

    def _write(self, entries: dict[str, Any], meta: dict[str, Any]) -> None:
        started = time.perf_counter()
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            try:
                fenced = self._fenced(meta)
                if fenced is not None:
                    raise FencedWrite(fenced)
                self.store.write(entries, meta, fence=lambda: self._fenced(meta))
            except FencedWrite as e:
                self.last_error = f"the checkpoint {meta} was not written: {e}"
                logger.warning("%s", self.last_error)
                return
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
