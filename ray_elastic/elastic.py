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
from ray_elastic.runtime.process import current
from ray_elastic.state import State

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

R = TypeVar("R")

# raised inside the function but not the user's failure: the worker's own endings, and mistakes that repeat
_NOT_RETRIED = (*REPEATING, WorkerRemovedError, CoordinatorDiedError)


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Wrap `func(state, *args, **kwargs)` in the elastic loop."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        if not isinstance(state, State):
            raise TypeError(f"@elastic.run functions take a State as first argument, got {type(state).__name__}")
        ctx = current()
        ctx.ensure_joined()
        skip_sync = False
        while True:
            in_func = False
            try:
                if not skip_sync:
                    ctx.maybe_resume(state)
                    ctx.adopt_commits(state.commit_id)  # before the sync overwrites anything
                    state.sync()
                    ctx.mark_synced()
                in_func = True
                return func(state, *args, **kwargs)
            except HorovodInternalError as e:
                logger.info("rank %s: collective failed (%s); restoring the last commit", ctx.rank, e)
                ctx.tell_failure(str(e))  # the driver plans the next generation while this rank restores
                state.restore_before_sync()
                failed, skip_sync = True, False
            except HostsUpdatedInterrupt as e:
                # graceful change: keep the live state, which sync hands to newcomers
                state.keep_live()
                failed, skip_sync = False, e.skip_sync
            except Exception as e:
                # an error from inside torch's own machinery (DDP's reducer raises a failed allreduce from
                # backward() as a RuntimeError) is a ring failure, as is any error once the ring is abandoned
                broken = ctx.ring_failure(e)
                if broken is not None:
                    logger.info("rank %s: the ring broke (%s); restoring the last commit", ctx.rank, broken)
                    ctx.tell_failure(broken)
                elif in_func and not isinstance(e, _NOT_RETRIED):
                    # the user's own exception: the driver counts it against max_failures (once per generation)
                    # and fails the run, or every rank re-enters from the last commit, this one included
                    logger.warning("rank %s: train_fn raised %s; restoring the last commit", ctx.rank, e)
                    ctx.tell_raised(describe_exception(e), format_traceback(e))
                else:
                    raise
                state.restore_before_sync()
                failed, skip_sync = True, False
            ctx.reset(failed=failed)
            state.on_reset()

    return wrapper
