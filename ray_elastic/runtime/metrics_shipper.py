"""Rank 0's `report()` metrics: buffered without blocking, shipped to the driver in the background.

`report()` must never block training, so a call only appends to a buffer
under a lock; a daemon thread sends what accumulated every 0.25 s
(`driver.add_metrics`, not awaited), and `shutdown()` delivers the rest,
waiting for the driver's answer at most `timeout` seconds.

Every rank's pace summaries (`runtime/pace.py`, one every 1.5 s of
training) ride in the same batches, as `add_metrics(..., paces=[...])`: on
rank 0 with its reports, on the other ranks (whose reports are not kept) in
a batch that holds only them.

`snapshot()` pickles a report at the call (a few µs for a dict of numbers):
what is kept is a deep copy, so a list the code mutates afterwards does not
change the reported value, and a value that cannot be shipped fails at the
`report()` that passed it, naming its key, instead of in the background.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import ray
from ray import cloudpickle

if TYPE_CHECKING:
    from ray_elastic.protocol import PaceSummary
    from ray_elastic.wire import DriverLink

logger = logging.getLogger(__name__)

_FLUSH_INTERVAL_S = 0.25
_SEND_TIMEOUT_S = 120.0  # a batch's delivery, a driver restart included


def snapshot(metrics: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """`(now, a deep copy of metrics)`; a TypeError naming the key whose value cannot be pickled."""
    if not isinstance(metrics, dict):
        raise TypeError(f"report() takes a dict of metrics, got {type(metrics).__name__}")
    try:
        blob = cloudpickle.dumps(metrics)
    except Exception as e:  # noqa: BLE001 - pickling may raise anything; find the culprit
        for key, value in metrics.items():
            try:
                cloudpickle.dumps(value)
            except Exception:  # noqa: BLE001
                raise TypeError(
                    f"report(): the value of {key!r} ({type(value).__name__}) cannot be pickled, so it cannot "
                    f"reach fit(): {type(e).__name__}: {e}"
                ) from e
        raise TypeError(f"report(): the metrics cannot be pickled: {type(e).__name__}: {e}") from e
    return time.time(), pickle.loads(blob)


class MetricsShipper:
    """A buffer of `(time, metrics)` and the thread that ships it.

    Args:
        worker_id: the sender's id in `driver.add_metrics(worker_id, batch)`.
        driver: the driver actor's handle.
    """

    def __init__(self, worker_id: str, driver: DriverLink) -> None:
        self.worker_id = worker_id
        self.driver = driver
        self._buffer: deque[tuple[float, dict[str, Any]]] = deque()
        self._paces: deque[PaceSummary] = deque()
        self._sent = 0  # batches sent: each carries its number, so a driver restarted in between takes it once
        self._delivered = 0  # the number of the last batch the driver answered
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="ray-elastic-metrics", daemon=True)
        self._flusher.start()

    def add(self, stamped: tuple[float, dict[str, Any]]) -> None:
        """Buffer a `(time, snapshot(metrics))`; never blocks on the driver."""
        with self._lock:
            self._buffer.append(stamped)

    def add_pace(self, summary: PaceSummary) -> None:
        """Buffer one of this rank's pace summaries (the pace meter's sink); never blocks."""
        with self._lock:
            self._paces.append(summary)

    def _drain(self) -> tuple[int, list[tuple[float, dict[str, Any]]], list[PaceSummary]]:
        with self._lock:
            batch, paces = list(self._buffer), list(self._paces)
            self._buffer.clear()
            self._paces.clear()
            if batch or paces:
                self._sent += 1
            return self._sent, batch, paces

    def _send(
        self, seq: int, batch: list[tuple[float, dict[str, Any]]], paces: list[PaceSummary], timeout: float
    ) -> None:
        # paces only when there are some: a batch of reports alone is the call it always was
        extra = {"paces": paces} if paces else {}
        ray.get(self.driver.add_metrics.remote(self.worker_id, batch, seq, **extra), timeout=timeout)
        with self._lock:
            self._delivered = max(self._delivered, seq)

    def delivered(self) -> bool:
        """Whether everything buffered so far has reached the driver (a SIGKILL loses what has not)."""
        with self._lock:
            return not self._buffer and not self._paces and self._delivered == self._sent

    def _flush_loop(self) -> None:
        while not self._stop.wait(_FLUSH_INTERVAL_S):
            seq, batch, paces = self._drain()
            if batch or paces:
                try:
                    # one batch at a time, so they arrive in order even when Ray sends one again to a
                    # restarted driver; training never waits for this thread
                    self._send(seq, batch, paces, _SEND_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - the thread must outlive one failed send
                    logger.exception("worker %s could not ship %d reports", self.worker_id, len(batch))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread and deliver the last metrics, waiting up to `timeout` s for the driver."""
        self._stop.set()
        self._flusher.join(timeout)
        seq, batch, paces = self._drain()
        if batch or paces:
            self._send(seq, batch, paces, timeout)
