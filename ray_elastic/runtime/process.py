"""The process's current worker runtime, and the activity marks its collectives leave.

One worker actor is one process, so the runtime is a process-wide singleton.
This module imports nothing else of the package: the public functions
(`ray_elastic.rank()`, the collectives), the torch helpers and the backends'
`guarded_call` all find the runtime here, and the runtime itself is built on
top of them, so none of them has to import it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray_elastic.worker_context import WorkerContext


class ActivityMarks:
    """When this worker last started or finished a collective, and whether it is inside one now.

    The driver reads them through the worker's control thread: a member that
    shows no activity while the others time out is stuck in user code.
    """

    def __init__(self) -> None:
        self.last = time.time()
        self.in_collective = False

    def mark(self, inside: bool) -> None:
        self.in_collective = inside
        self.last = time.time()


_current: WorkerContext | None = None


def set_current(ctx: WorkerContext | None) -> None:
    """Make `ctx` this process's runtime (the worker actor does, once)."""
    global _current
    _current = ctx


def current() -> WorkerContext:
    """This process's runtime; a clear error outside an elastic worker."""
    if _current is None:
        raise RuntimeError("this ray_elastic function only works inside train_fn running under ElasticTrainer.fit()")
    return _current


def maybe_current() -> WorkerContext | None:
    """This process's runtime, or None outside an elastic worker."""
    return _current


def collective_activity(inside: bool) -> None:
    """Backends call this entering (True) and leaving (False) a blocking collective."""
    ctx = _current
    if ctx is not None:
        ctx.activity.mark(inside)
