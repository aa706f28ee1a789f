"""`run`: the sync / call / restore / reset loop around the user's training.

    @elastic.run
    def train(state): ...

On entry the worker joins the ring and `state.sync()` gives every rank rank
0's state. Then the function runs. If a collective fails
(`HorovodInternalError`, or an error the runtime knows for a broken ring's,
as when DDP's reducer fails in `backward()`), the state rolls back
to the last commit; if hosts changed gracefully (`HostsUpdatedInterrupt`),
the live state is kept. If the function itself raises, the driver counts
one failure of the attempt against `max_failures` and fails the run, or
every rank rolls back and re-enters (Ray Train's counting). Either
way the ring is rebuilt for the driver's next generation, reset callbacks
run, the state is synced again and the function is called again. A worker
left out of the new generation leaves with `WorkerRemovedError`, which its
actor turns into a clean exit. The driver bounds the number of resets.

The loop runs on the state's worker runtime (`State.worker_context()`): it
joins, syncs, tells the driver and resets through it, one `Generation` at a
time, and says so in its signature (`_loop`).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, TypeVar

from ray_elastic.exceptions import (
    REPEATING,
    CoordinatorDiedError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    WorkerRemovedError,
    describe_exception,
    format_traceback,
)
from ray_elastic.state import State

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.runtime.context import WorkerContext

logger = logging.getLogger(__name__)

R = TypeVar("R")

# raised inside the function but not the user's failure: the worker's own endings, and mistakes that repeat
_NOT_RETRIED = (*REPEATING, WorkerRemovedError, CoordinatorDiedError)


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Wrap `func(state, *args, **kwargs)` in the elastic loop, on `state`'s worker runtime."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise TypeError(f"@elastic.run functions take a State as first argument, got {type(state).__name__}")
        return _loop(state.worker_context(), state, functools.partial(func, state, *args, **kwargs))

    return wrapper


def _loop(worker: WorkerContext, state: State, call: Callable[[], R]) -> R:
    """Join, sync `state`, `call()`; on a failure restore, reset and again, until `call()` returns."""
    worker.boot_marks.mark("loop_entered")
    skip_sync = False
    while True:
        in_func = False
        generation = worker.joined()  # the first join, or the generation the last reset joined
        try:
            if not skip_sync:
                worker.maybe_resume(generation, state)
                worker.adopt_commits(generation, state.commit_id)  # before the sync overwrites anything
                state.sync()
                worker.mark_synced()
            in_func = True
            return call()
        except HorovodInternalError as e:
            logger.info("rank %s: collective failed (%s); restoring the last commit", generation.rank, e)
            worker.tell_failure(str(e))  # the driver plans the next generation while this rank restores
            state.restore_before_sync()
            failed, skip_sync = True, False
        except HostsUpdatedInterrupt as e:
            # graceful change: keep the live state, which sync hands to newcomers
            state.keep_live()
            failed, skip_sync = False, e.skip_sync
        except Exception as e:
            # an error from inside torch's own machinery (DDP's reducer raises a failed allreduce from
            # backward() as a RuntimeError) is a ring failure, as is any error once the ring is abandoned
            broken = worker.ring_failure(e)
            if broken is not None:
                logger.info("rank %s: the ring broke (%s); restoring the last commit", generation.rank, broken)
                worker.tell_failure(broken)
            elif in_func and not isinstance(e, _NOT_RETRIED):
                # the user's own exception: the driver counts it against max_failures (once per generation)
                # and fails the run, or every rank re-enters from the last commit, this one included
                logger.warning("rank %s: train_fn raised %s; restoring the last commit", generation.rank, e)
                worker.tell_raised(describe_exception(e), format_traceback(e))
            else:
                raise
            state.restore_before_sync()
            failed, skip_sync = True, False
        worker.reset(failed=failed)
        state.on_reset()
