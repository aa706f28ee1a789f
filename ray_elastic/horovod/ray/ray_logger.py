"""horovod.ray's `ray_logger.log(info)`: a worker's dict for the driver's callbacks, through `report()`.

`from ray_elastic.horovod.ray import ray_logger` then `ray_logger.log({...})`
inside the executor's function is `ray_elastic.report({...})`: rank 0's
reports reach the `callbacks` of `run()`/`execute()` (horovod.ray's
docstring says as much: "every value logged by the rank 0 worker") and never
block training. A dict logged on another rank is not delivered; the first
one says so in a warning, as does a call outside a worker.

`configure(queue)` (horovod.ray's, which its worker calls with the
executor's queue) sends later dicts to `queue.put()` instead, as horovod.ray
does: for code that reads its own queue. The executors here never call it.
"""

from __future__ import annotations

import warnings
from typing import Any

from ray_elastic.runtime import maybe_current

_warned: set[str] = set()
_queue: Any = None


def configure(queue: Any) -> None:
    """Send every later `log()` dict to `queue.put()` (None: back to the callbacks)."""
    global _queue
    if queue is not None and not callable(getattr(queue, "put", None)):
        raise ValueError(f"ray_logger.configure needs a queue with put(), got {queue!r}")
    _queue = queue


def log(info_dict: dict[str, Any]) -> None:
    """Send `info_dict` to the callbacks (from rank 0; other ranks' are dropped, said once), or the configured queue."""
    if _queue is not None:
        _queue.put(info_dict)
        return
    ctx = maybe_current()
    if ctx is None:
        _warn_once("outside", "ray_logger.log called outside an executor's worker: nothing receives it")
        return
    ctx.report(info_dict)
    slot = ctx.slot
    if slot is not None and slot.rank != 0:
        _warn_once("rank", f"ray_logger.log on rank {slot.rank}: only rank 0's dicts reach the callbacks")


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)
