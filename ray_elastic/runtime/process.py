"""The process's current worker runtime.

One worker actor is one process, so the runtime is a process-wide singleton.
This module imports nothing else of the package, not even for types: the
public functions (`ray_elastic.rank()`, the collectives), the torch helpers
and the state classes find the runtime here, and the runtime
(`worker_context.WorkerContext`) is built on top of them, so none of them
has to import it. The holder is typed `Any` for that reason: naming
`WorkerContext` here would close a circle of dependences.
"""

from __future__ import annotations

from typing import Any

_current: Any = None  # a worker_context.WorkerContext, or None outside a worker


def set_current(ctx: Any) -> None:
    """Make `ctx` this process's runtime (the worker actor does, once)."""
    global _current
    _current = ctx


def current() -> Any:
    """This process's runtime; a clear error outside an elastic worker."""
    if _current is None:
        raise RuntimeError("this ray_elastic function only works inside train_fn running under ElasticTrainer.fit()")
    return _current


def maybe_current() -> Any:
    """This process's runtime, or None outside an elastic worker."""
    return _current
