"""The executor's mailbox: commands to the workers, and their results back, by rank.

One small async Ray actor per executor (no CPU, on the executor's node, as
horovod.ray puts its callback queue). In a static `RayExecutor` the workers
stay in a serving loop between calls (see `worker_loop.py`): each call is a
numbered command they fetch here, and each rank posts its outcome under
that number. In elastic mode each worker posts its function's result once,
under the generation it finished in. Outcomes travel pickled (cloudpickle)
from the worker, so an unpicklable result is the worker's clear error, and
the mailbox never needs the user's classes except to hand a value to
`run_remote`'s `ray.get`.

Every wait here has a deadline the caller gives; `fail(reason)` releases
every waiter at once with that reason (the session ended).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import ray
from ray import cloudpickle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

if TYPE_CHECKING:
    from collections.abc import Callable

STOP = "stop"  # the command that ends the workers' serving loop


class SessionEnded(RuntimeError):
    """The executor's workers are gone (shutdown, or the run failed); the message says why."""


class Mailbox:
    """Commands `(kind, fn, ranks)` in order, outcomes `{seq: {rank: (ok, blob)}}`, and who has started."""

    def __init__(self) -> None:
        self._commands: list[tuple[str, Any, frozenset[int] | None]] = []
        self._outcomes: dict[int, dict[int, tuple[bool, bytes]]] = {}
        self._started: dict[int, tuple[bool, bytes | None]] = {}  # rank -> (ok, the error if not)
        self._actors: dict[int, str] = {}  # rank -> the worker actor's id, to watch it
        self._failure: str | None = None
        self._changed: asyncio.Condition | None = None

    async def _wait(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: predicate() or self._failure), timeout)
            except asyncio.TimeoutError:
                pass
        return predicate()

    async def _notify(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            self._changed.notify_all()

    async def send(self, kind: str, fn: Any, ranks: frozenset[int] | None = None) -> int:
        """Queue a command for every rank (or `ranks`); returns its number."""
        self._commands.append((kind, fn, ranks))
        await self._notify()
        return len(self._commands) - 1

    async def next_command(self, seq: int, timeout: float) -> tuple[str, Any, frozenset[int] | None] | None:
        """Command `seq` once it is sent; None after `timeout` seconds; `STOP` once the session failed."""
        await self._wait(lambda: len(self._commands) > seq, timeout)
        if len(self._commands) > seq:
            return self._commands[seq]
        return (STOP, None, None) if self._failure else None

    async def started(self, rank: int, ok: bool, error: bytes | None = None, actor_id: str | None = None) -> None:
        """A worker joined the ring and built its executable (`ok`), or failed to (`error`, pickled)."""
        self._started[rank] = (ok, error)
        if actor_id is not None:
            self._actors[rank] = actor_id
        await self._notify()

    async def wait_started(self, count: int, timeout: float) -> dict[int, tuple[bool, bytes | None]]:
        """The workers started so far, once `count` have or after `timeout` seconds."""
        await self._wait(lambda: len(self._started) >= count, timeout)
        return dict(self._started)

    async def post(self, seq: int, rank: int, ok: bool, blob: bytes) -> None:
        """Rank `rank`'s outcome of command (or generation) `seq`: a pickled value, or a pickled exception."""
        self._outcomes.setdefault(seq, {})[rank] = (ok, blob)
        await self._notify()

    async def outcomes(self, seq: int, ranks: list[int], timeout: float) -> dict[int, tuple[bool, bytes]]:
        """The outcomes of `seq` posted so far, once `ranks` all have or after `timeout` seconds."""
        await self._wait(lambda: set(ranks) <= set(self._outcomes.get(seq, {})), timeout)
        if self._failure and not set(ranks) <= set(self._outcomes.get(seq, {})):
            raise SessionEnded(self._failure)
        return dict(self._outcomes.get(seq, {}))

    async def value(self, seq: int, rank: int) -> Any:
        """Rank `rank`'s result of `seq` (what `run_remote`'s refs resolve to); its exception if it raised."""
        await self._wait(lambda: rank in self._outcomes.get(seq, {}), None)
        if rank not in self._outcomes.get(seq, {}):
            raise SessionEnded(self._failure)
        ok, blob = self._outcomes[seq][rank]
        value = cloudpickle.loads(blob)
        if not ok:
            raise value
        return value

    def actors(self) -> dict[int, str]:
        """The started workers' actor ids, by rank."""
        return self._actors

    def all_outcomes(self) -> dict[int, dict[int, tuple[bool, bytes]]]:
        return self._outcomes

    async def fail(self, reason: str) -> None:
        """The session is over: every wait ends now, naming `reason`."""
        self._failure = reason
        await self._notify()


def create_mailbox() -> Any:
    """A mailbox actor on this process's node (no CPU), owned by this process: it goes when the script ends."""
    here = ray.get_runtime_context().get_node_id()
    return (
        ray.remote(Mailbox)
        .options(num_cpus=0, max_concurrency=1000, scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True))
        .remote()
    )
