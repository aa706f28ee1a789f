"""Rank 0's `report()` metrics: buffered without blocking, shipped to the driver in the background.

`report()` must never block training, so a call only appends to a buffer
under a lock; a daemon thread sends what accumulated every 0.25 s
(`driver.add_metrics`, not awaited), and `shutdown()` delivers the rest,
waiting for the driver's answer at most `timeout` seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import ray

_FLUSH_INTERVAL_S = 0.25


class MetricsShipper:
    """A buffer of `(time, metrics)` and the thread that ships it.

    Args:
        worker_id: the sender's id in `driver.add_metrics(worker_id, batch)`.
        driver: the driver actor's handle.
    """

    def __init__(self, worker_id: str, driver: ray.actor.ActorHandle) -> None:
        self.worker_id = worker_id
        self.driver = driver
        self._buffer: deque[tuple[float, dict[str, Any]]] = deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="ray-elastic-metrics", daemon=True)
        self._flusher.start()

    def add(self, metrics: dict[str, Any]) -> None:
        """Buffer a copy of `metrics`, stamped with the time; never blocks on the driver."""
        with self._lock:
            self._buffer.append((time.time(), dict(metrics)))

    def _drain(self) -> list[tuple[float, dict[str, Any]]]:
        with self._lock:
            batch = list(self._buffer)
            self._buffer.clear()
        return batch

    def _flush_loop(self) -> None:
        while not self._stop.wait(_FLUSH_INTERVAL_S):
            batch = self._drain()
            if batch:
                self.driver.add_metrics.remote(self.worker_id, batch)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread and deliver the last metrics, waiting up to `timeout` s for the driver."""
        self._stop.set()
        self._flusher.join(timeout)
        batch = self._drain()
        if batch:
            ray.get(self.driver.add_metrics.remote(self.worker_id, batch), timeout=timeout)
