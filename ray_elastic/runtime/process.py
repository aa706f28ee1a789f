"""The process's current worker runtime.

One worker actor is one process, so the runtime is a process-wide singleton:
the worker actor makes its `WorkerContext` current once, and the public
entry points find it here, typed: the functions users call
(`ray_elastic.rank()`, the collectives, `report()`, `prepare_model()`), the
constructors that take it by default (`State`, `TorchState`,
`DistributedOptimizer`) and the adapters. Everything below them is handed
the context (or one `Generation` of it) as an argument, so a signature says
what a function depends on. They call it by its named methods
(`runtime/context.py`), never through its parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray_elastic.runtime.context import WorkerContext

_current: WorkerContext | None = None  # None outside a worker


def set_current(ctx: WorkerContext | None) -> None:
    """Make `ctx` this process's runtime (the worker actor does, once; tests set and clear it)."""
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
