"""The rendezvous server: generation-scoped keys and server-side waits, in plain asyncio.

This is the logic of the run's KV actor (`rendezvous.KVStore` wraps it for
Ray), kept free of Ray so it runs, and is tested, under any event loop.

Every key lives in a generation (one generation per reset round), so keys of
generation g are never read by generation g+1, and a wait for a key of an old
generation fails with `GenerationSupersededError` as soon as a newer one is
published: a worker stuck forming a ring with a peer that died is released at
once instead of waiting out its timeout. All waits happen here, as asyncio
futures woken by the write they wait for; clients never poll. Every wait is
bounded by the caller's timeout and ends with `RendezvousTimeoutError`.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import zlib
from dataclasses import dataclass
from typing import Any

from ray_elastic.exceptions import GenerationSupersededError, RendezvousTimeoutError


def pack_family(values: list[bytes]) -> bytes:
    """A family's values as one compressed blob (Gloo's addresses are mostly zero padding)."""
    return zlib.compress(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL), 1)


def unpack_family(packed: bytes) -> list[bytes]:
    """The values `pack_family` packed."""
    return pickle.loads(zlib.decompress(packed))


@dataclass(eq=False)
class _Family:
    """Keys `<prefix>0` .. `<prefix>{count-1}` of one generation that ranks wait for together."""

    generation: int
    prefix: str
    count: int
    missing: set[int]  # indices not written yet
    done: asyncio.Future  # set once none is missing (or failed when the generation is superseded)
    reply: Any = None  # the values, packed once complete and shared (see `KVServer.share_reply`)

    def note(self, key: str, present: bool) -> bool:
        """Key `key` came (`present`) or went; whether that completed the family (no member missing now)."""
        suffix = key[len(self.prefix) :]
        if not key.startswith(self.prefix) or not suffix.isdigit():
            return False
        index = int(suffix)
        if index >= self.count or suffix != str(index):  # "07" is not rank 7's key
            return False
        if not present:
            self.missing.add(index)
            return False
        self.missing.discard(index)
        return not self.missing


class KVServer:
    """The KV actor's logic: an asyncio object, run by Ray as `rendezvous.KVStore` or by any event loop.

    Every method is a coroutine of one event loop (an asyncio actor's), so
    no lock is needed. Waits take a `timeout` in seconds and end with
    `RendezvousTimeoutError` naming what was missing.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._data: dict[tuple[int, str], bytes] = {}
        self._waiters: dict[tuple[int, str], set[asyncio.Future]] = {}
        self._generation = 0
        self._assignment: dict[str, Any] = {}
        self._snapshot_confirmed = 0  # the newest driver snapshot the driver said it wrote
        self._generation_waiters: set[asyncio.Future] = set()
        self._calls = 0  # key and generation-wait calls so far: the traffic a generation costs
        # per-rank families being waited for, by (generation, prefix, count); a complete one's values
        # are encoded once and the same reply goes to every rank
        self._families: dict[tuple[int, str, int], _Family] = {}
        # keys of no generation, kept until overwritten (lost with the actor: what is here is a hint)
        self._lasting: dict[str, bytes] = {}

    def share_reply(self, packed: bytes) -> Any:
        """How a complete family's packed values go back to every rank: here as they are.

        The Ray actor hands large ones out by object reference instead.
        """
        return packed

    # ---- generations -------------------------------------------------
    async def publish(self, generation: int, assignment: dict[str, Any]) -> None:
        """Make `generation` current; older generations' waits fail, their keys go."""
        if generation <= self._generation:
            raise ValueError(f"generation {generation} is not newer than {self._generation}")
        self._make_current(generation, assignment)

    def _make_current(self, generation: int, assignment: dict[str, Any]) -> None:
        """`generation` is current: drop older keys, fail older waits at once, wake the generation waiters."""
        self._generation = generation
        self._assignment = assignment
        for key in [k for k in self._data if k[0] < generation]:
            del self._data[key]
        for family_key, family in list(self._families.items()):
            if family_key[0] < generation:
                del self._families[family_key]
                if not family.done.done():
                    family.done.set_exception(
                        GenerationSupersededError(f"generation {key[0]} superseded by {generation}")
                    )
                    family.done.exception()  # retrieved: no "never retrieved" log if no caller waits any more
        for key in [k for k in self._waiters if k[0] < generation]:
            for fut in self._waiters.pop(key):
                if not fut.done():
                    fut.set_exception(GenerationSupersededError(f"generation {key[0]} superseded by {generation}"))
        waiters, self._generation_waiters = self._generation_waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait_generation(
        self, after: int, timeout: float, worker_id: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        """The newest published generation greater than `after`, waiting up to `timeout` s.

        With `worker_id`, the assignment holds only that worker's entry (empty
        if it is not in the generation): N workers then fetch O(N) bytes in
        all, not N copies of the whole plan.
        """
        self._calls += 1
        deadline = time.monotonic() + timeout
        while self._generation <= after:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"timed out after {timeout:g} s waiting for the driver to publish a generation after {after} "
                    f"(run {self.run_id})"
                )
            fut = asyncio.get_running_loop().create_future()
            self._generation_waiters.add(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                self._generation_waiters.discard(fut)
        if worker_id is None:
            return self._generation, self._assignment
        mine = self._assignment.get(worker_id)
        return self._generation, ({} if mine is None else {worker_id: mine})

    async def hold(self) -> None:
        """Never returns while the actor lives: the driver keeps one call pending to learn of its death."""
        await asyncio.Event().wait()

    async def current_generation(self) -> int:
        return self._generation

    async def confirm_snapshot(self, counter: int) -> None:
        """The driver wrote its `counter`-th snapshot (calls may arrive out of order: the newest is kept)."""
        self._snapshot_confirmed = max(self._snapshot_confirmed, counter)

    async def snapshot_confirmed(self) -> int:
        """The newest driver snapshot confirmed: a restarted driver refuses an older one (`judge_snapshot`)."""
        return self._snapshot_confirmed

    async def restore(self, generation: int, assignment: dict[str, Any]) -> None:
        """Make `generation` current again if it is newer; an older or equal one changes nothing.

        A restarted (empty) actor learns it so; a restarted driver sends it
        too, as its predecessor may have died before publishing it: then the
        older generations' waits are failed as `publish` fails them.
        """
        if generation > self._generation:
            self._make_current(generation, assignment)

    # ---- keys ----------------------------------------------------------
    def _check_generation(self, generation: int) -> None:
        if generation < self._generation:
            raise GenerationSupersededError(f"generation {generation} superseded by {self._generation}")

    def _put(self, generation: int, key: str, value: bytes) -> None:
        new = (generation, key) not in self._data
        self._data[(generation, key)] = value
        if new and self._families:
            self._count_family_key(generation, key, present=True)
        for fut in self._waiters.pop((generation, key), ()):
            if not fut.done():
                fut.set_result(None)

    async def set(self, generation: int, key: str, value: bytes) -> None:
        self._calls += 1
        self._check_generation(generation)
        self._put(generation, key, value)

    async def set_lasting(self, key: str, value: bytes) -> None:
        """A key of no generation: it outlives resets (not a restart of this actor). Rank 0's state layout."""
        self._calls += 1
        self._lasting[key] = value

    async def get_lasting(self, key: str) -> bytes | None:
        """A key `set_lasting` wrote, or None: never waits."""
        self._calls += 1
        return self._lasting.get(key)

    async def note(self, generation: int, key: str, value: bytes) -> None:
        """`set` for a caller that does not wait for the answer: a superseded generation's write is dropped."""
        self._calls += 1
        if generation >= self._generation:
            self._put(generation, key, value)

    async def multi_set(self, generation: int, items: list[tuple[str, bytes]]) -> None:
        self._calls += 1
        self._check_generation(generation)
        for key, value in items:
            self._put(generation, key, value)

    async def wait(self, generation: int, keys: list[str], timeout: float) -> None:
        """Return once every key exists; bounded by `timeout`, failed by a newer generation."""
        self._calls += 1
        await self._wait(generation, keys, timeout)

    async def _wait(self, generation: int, keys: list[str], timeout: float) -> None:
        # Keys are awaited one at a time, in order, each with a future of its own: a wait for N keys
        # costs O(N) however the writes interleave (a future on every missing key, rechecked after each
        # write, made N ranks waiting for N addresses cost O(N^3) at 1024 ranks).
        deadline = time.monotonic() + timeout
        data = self._data
        start = 0
        while True:
            self._check_generation(generation)
            missing = next((i for i in range(start, len(keys)) if (generation, keys[i]) not in data), None)
            if missing is None:
                # every key was seen; one pass from the start, since a key may have been deleted meanwhile
                missing = next((i for i in range(len(keys)) if (generation, keys[i]) not in data), None)
                if missing is None:
                    return
            start = missing
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                absent = [k for k in keys if (generation, k) not in data]
                raise RendezvousTimeoutError(
                    f"timed out after {timeout:g} s waiting for keys {absent[:4]} of generation {generation} "
                    f"(run {self.run_id}): a peer did not join"
                )
            key = (generation, keys[missing])
            fut = asyncio.get_running_loop().create_future()
            self._waiters.setdefault(key, set()).add(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.discard(fut)
                    if not waiters:
                        del self._waiters[key]

    async def get(self, generation: int, key: str, timeout: float) -> bytes:
        self._calls += 1
        await self._wait(generation, [key], timeout)
        return self._data[(generation, key)]

    async def multi_get(self, generation: int, keys: list[str], timeout: float) -> list[bytes]:
        self._calls += 1
        await self._wait(generation, keys, timeout)
        return [self._data[(generation, k)] for k in keys]

    async def wait_family(
        self, generation: int, prefix: str, count: int, timeout: float, put: tuple[str, bytes] | None = None
    ) -> list[Any]:
        """`[reply]`: the values of `prefix0` .. `prefix{count-1}` once all exist (`unpack_family` reads it).

        One call instead of `count` waits and gets: how a rank reads every
        peer's address when a ring forms. With `put` (a key and its value),
        the caller's own key is written first, in the same call: a rank's
        whole share of a ring is then this one call. The values are packed
        once per family and the same reply goes to every rank (see
        `share_reply`). The family's keys must be written once per
        generation (Gloo's per-rank addresses are).

        A family counts its missing keys as they are written, and all its
        waiters wait on one future set when the count reaches zero: N ranks
        waiting for the same N keys cost O(N) in all, one wake-up each,
        whatever order the keys come in.
        """
        self._calls += 1
        self._check_generation(generation)
        if put is not None:
            self._put(generation, *put)
        family = self._families.get((generation, prefix, count))
        if family is None:
            family = self._watch_family(generation, prefix, count)
        if family.reply is None:
            done, _ = await asyncio.wait({family.done}, timeout=timeout)
            if not done:
                absent = [f"{prefix}{i}" for i in range(count) if (generation, f"{prefix}{i}") not in self._data]
                raise RendezvousTimeoutError(
                    f"timed out after {timeout:g} s waiting for keys {absent[:4]} of generation {generation} "
                    f"(run {self.run_id}): a peer did not join"
                )
            family.done.result()  # raises GenerationSupersededError if a newer generation came first
        return [family.reply]

    def _watch_family(self, generation: int, prefix: str, count: int) -> _Family:
        """Start counting the family's keys: one scan now, then one decrement per new key in `_put`."""
        missing = {i for i in range(count) if (generation, f"{prefix}{i}") not in self._data}
        family = _Family(generation, prefix, count, missing, asyncio.get_running_loop().create_future())
        self._families[(generation, prefix, count)] = family
        if not missing:
            self._complete(family)
        return family

    def _complete(self, family: _Family) -> None:
        keys = [(family.generation, f"{family.prefix}{i}") for i in range(family.count)]
        family.reply = self.share_reply(pack_family([self._data[k] for k in keys]))
        if not family.done.done():
            family.done.set_result(None)

    def _count_family_key(self, generation: int, key: str, present: bool) -> None:
        """Key `key` came (`present`) or went: update the incomplete families of `generation` it belongs to."""
        for family in self._families.values():  # a family or two per generation
            if family.generation == generation and family.reply is None and family.note(key, present):
                self._complete(family)

    async def add(self, generation: int, key: str, amount: int) -> int:
        self._calls += 1
        self._check_generation(generation)
        value = int(self._data.get((generation, key), b"0")) + amount
        self._put(generation, key, str(value).encode())
        return value

    async def compare_set(self, generation: int, key: str, expected: bytes, desired: bytes) -> bytes:
        self._calls += 1
        self._check_generation(generation)
        current = self._data.get((generation, key))
        if (current is None and expected == b"") or current == expected:
            self._put(generation, key, desired)
            return desired
        return expected if current is None else current

    async def check(self, generation: int, keys: list[str]) -> bool:
        self._calls += 1
        self._check_generation(generation)
        return all((generation, k) in self._data for k in keys)

    async def delete_key(self, generation: int, key: str) -> bool:
        self._calls += 1
        deleted = self._data.pop((generation, key), None) is not None
        if deleted and self._families:
            self._count_family_key(generation, key, present=False)
        return deleted

    async def num_keys(self, generation: int) -> int:
        self._calls += 1
        return sum(1 for g, _ in self._data if g == generation)

    async def stats(self) -> dict[str, int]:
        """Keys held, the current generation, and the key and generation-wait calls so far."""
        return {"keys": len(self._data), "generation": self._generation, "calls": self._calls}
