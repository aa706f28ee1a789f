"""Storage calls with a deadline: a hung mount or bucket must not hang the caller."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypeVar

from ray_elastic.exceptions import CheckpointError

if TYPE_CHECKING:
    from collections.abc import Callable

R = TypeVar("R")


def bounded_call(timeout: float, what: str, fn: Callable[[], R]) -> R:
    """`fn()` (a storage call), waited for at most `timeout` s; past it, `CheckpointError` naming `what`.

    Storage can hang rather than fail (a dead NFS mount, a bucket behind a
    lost route); the caller must not hang with it. `fn` runs on a daemon
    thread, which is left behind if it never returns. `what` names the call
    and the option that bounds it, e.g. "reading ... (collective_timeout)".
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name="ray-elastic-storage", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CheckpointError(f"{what} did not finish within {timeout:g} s")
    if error:
        raise error[0]
    return result[0]
