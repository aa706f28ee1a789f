"""How the driver shell reads its calls to workers: an answer, no answer in time, a death, or another error.

Only a death (`ActorDiedError`) is followed by a message of its own: the
worker's pending `run()` call fails too, and the core hears `WorkerDied`.
Any other error (the actor unreachable for now, a failed call) tells
nothing of the worker's fate, so it must not be read as a death (the core
would wait for a death message that never comes), nor be skipped (a
worker whose every ping fails would never be judged). It is read as no
answer: the core then judges the worker as silent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, cast

from ray.exceptions import ActorDiedError

from ray_elastic.driver.core.messages import ACTIVITY_ERROR, ACTIVITY_TIMEOUT

if TYPE_CHECKING:
    from collections.abc import Mapping

logger = logging.getLogger(__name__)


def is_death(result: object) -> bool:
    """Whether a call's result is the worker's death, which its `run()` call reports as well."""
    return isinstance(result, ActorDiedError)


def read_activity(worker_id: str, result: object) -> Mapping[str, Any] | str:
    """An `activity()` call's answer, or `ACTIVITY_ERROR` for a death; anything else that failed is no answer."""
    if is_death(result):
        return ACTIVITY_ERROR
    if isinstance(result, BaseException):
        if not isinstance(result, asyncio.TimeoutError):
            logger.warning("the activity query of worker %s failed: %s: %s", worker_id, type(result).__name__, result)
        return ACTIVITY_TIMEOUT
    return cast("Mapping[str, Any]", result)


def read_pings(results: Mapping[str, object]) -> tuple[frozenset[str], frozenset[str]]:
    """`(answered, silent)` of one liveness round; a dead worker is in neither (its death is reported)."""
    answered, silent = set(), set()
    for worker_id, result in results.items():
        if not isinstance(result, BaseException):
            answered.add(worker_id)
        elif not is_death(result):
            if not isinstance(result, asyncio.TimeoutError):
                logger.warning("the ping of worker %s failed: %s: %s", worker_id, type(result).__name__, result)
            silent.add(worker_id)
    return frozenset(answered), frozenset(silent)
