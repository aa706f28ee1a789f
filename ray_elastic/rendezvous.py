"""Rendezvous: one named key-value actor per trainer run.

Every key lives in a generation (one generation per reset round), so keys of
generation g are never read by generation g+1, and a wait for a key of an old
generation fails with `GenerationSupersededError` as soon as a newer one is
published: a worker stuck forming a ring with a peer that died is released at
once instead of waiting out its timeout. All waits happen inside the actor
(asyncio futures woken by the write they wait for); clients never poll.

The driver publishes each generation's assignment here; workers block in
`wait_generation` for the next one and get back only their own slot. A
generation's traffic is O(N) calls, two per rank: `wait_generation`, then one
`wait_family` call that writes the rank's address and fetches every peer's
(Gloo's full mesh would otherwise read the N addresses one key at a time,
2N^2 calls).
`KVClient` is the synchronous view used inside worker processes, and
`torch_store()` adapts it to a `torch.distributed.Store` for the Gloo backend.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import ray

from ray_elastic.exceptions import CoordinatorDiedError, GenerationSupersededError, RendezvousTimeoutError

# extra seconds a client waits for the actor's own bounded answer
_CLIENT_MARGIN_S = 10.0
# a family's encoded values up to this size go back inside each reply; larger ones by object reference
# (under Ray's 100 KiB limit for values returned inline)
_INLINE_FAMILY_BYTES = 64 * 1024


def encode_family(values: list[bytes]) -> bytes | ray.ObjectRef:
    """A family's values as one reply for every rank: compressed bytes, or a reference to them when large.

    Gloo's addresses are mostly zero padding and compress several-fold, so
    for a thousand ranks the reply still goes back inline. Against handing
    every rank an object reference (which makes each reader a borrower the
    actor has to track), that halved the actor's CPU per call at 1024
    callers (bench/RESULTS.md, item 8).
    """
    blob = zlib.compress(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL), 1)
    return blob if len(blob) <= _INLINE_FAMILY_BYTES else ray.put(blob)


def decode_family(reply: bytes | ray.ObjectRef, timeout: float = _CLIENT_MARGIN_S) -> list[bytes]:
    """The values `encode_family` encoded (fetching them first if they came by reference)."""
    if isinstance(reply, ray.ObjectRef):
        try:
            reply = ray.get(reply, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RendezvousTimeoutError(f"fetching a family of values took over {timeout:g} s") from None
    return pickle.loads(zlib.decompress(reply))


@dataclass(eq=False)
class _Family:
    """Keys `<prefix>0` .. `<prefix>{count-1}` of one generation that ranks wait for together."""

    generation: int
    prefix: str
    count: int
    missing: set[int]  # indices not written yet
    done: asyncio.Future  # set once none is missing (or failed when the generation is superseded)
    reply: bytes | ray.ObjectRef | None = None  # the values, encoded once complete (see `encode_family`)


class KVStore:
    """The KV actor's logic (wrapped by `ray.remote` in `create_kv_actor`)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._data: dict[tuple[int, str], bytes] = {}
        self._waiters: dict[tuple[int, str], set[asyncio.Future]] = {}
        self._generation = 0
        self._assignment: dict[str, Any] = {}
        self._generation_waiters: set[asyncio.Future] = set()
        self._calls = 0  # key and generation-wait calls so far: the traffic a generation costs
        # per-rank families being waited for, by (generation, prefix, count); a complete one's values
        # are encoded once and the same reply goes to every rank
        self._families: dict[tuple[int, str, int], _Family] = {}

    # ---- generations -------------------------------------------------
    async def publish(self, generation: int, assignment: dict[str, Any]) -> None:
        """Make `generation` current; older generations' waits fail, their keys go."""
        if generation <= self._generation:
            raise ValueError(f"generation {generation} is not newer than {self._generation}")
        self._generation = generation
        self._assignment = assignment
        for key in [k for k in self._data if k[0] < generation]:
            del self._data[key]
        for key, family in list(self._families.items()):
            if key[0] < generation:
                del self._families[key]
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
    ) -> list[ray.ObjectRef]:
        """`[reply]`: the values of `prefix0` .. `prefix{count-1}` once all exist (`decode_family` reads it).

        One call instead of `count` waits and gets: how a rank reads every
        peer's address when a ring forms. With `put` (a key and its value),
        the caller's own key is written first, in the same call: a rank's
        whole share of a ring is then this one call. The values are encoded
        once per family and the same reply goes to every rank (see
        `encode_family`). The family's keys must be written once per
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
        family.reply = encode_family([self._data[k] for k in keys])
        if not family.done.done():
            family.done.set_result(None)

    def _count_family_key(self, generation: int, key: str, present: bool) -> None:
        """Key `key` came (`present`) or went: update the incomplete families of `generation` it belongs to."""
        for family in self._families.values():  # a family or two per generation
            suffix = key[len(family.prefix) :]
            if family.generation != generation or family.reply is not None:
                continue
            if not key.startswith(family.prefix) or not suffix.isdigit():
                continue
            index = int(suffix)
            if index >= family.count or suffix != str(index):  # "07" is not rank 7's key
                continue
            if present:
                family.missing.discard(index)
                if not family.missing:
                    self._complete(family)
            else:
                family.missing.add(index)

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


def create_kv_actor(run_id: str, namespace: str, scheduling_strategy: Any = None) -> ray.actor.ActorHandle:
    """Start the run's KV actor, named `kv` in the run's own namespace."""
    actor_cls = ray.remote(num_cpus=0, max_restarts=0)(KVStore)
    return actor_cls.options(
        name="kv", namespace=namespace, max_concurrency=100_000, scheduling_strategy=scheduling_strategy
    ).remote(run_id)


class KVClient:
    """Synchronous access to the KV actor from a worker process.

    Every call is bounded: the actor bounds its own waits and the client adds
    a margin for the round trip, so no call blocks without a deadline.
    """

    def __init__(self, handle: ray.actor.ActorHandle) -> None:
        self.handle = handle

    def _call(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        ref = getattr(self.handle, method).remote(*args)
        try:
            return ray.get(ref, timeout=timeout + _CLIENT_MARGIN_S)
        except ray.exceptions.GetTimeoutError:
            raise RendezvousTimeoutError(
                f"the KV actor did not answer {method} within {timeout + _CLIENT_MARGIN_S:g} s"
            ) from None
        except ray.exceptions.RayActorError as e:
            raise CoordinatorDiedError(f"the run's rendezvous (KV) actor died: {str(e).splitlines()[0]}") from None

    def wait_generation(self, after: int, timeout: float, worker_id: str | None = None) -> tuple[int, dict[str, Any]]:
        return self._call("wait_generation", after, timeout, worker_id, timeout=timeout)

    def set(self, generation: int, key: str, value: bytes) -> None:
        self._call("set", generation, key, value)

    def get(self, generation: int, key: str, timeout: float) -> bytes:
        return self._call("get", generation, key, timeout, timeout=timeout)

    def multi_get(self, generation: int, keys: Iterable[str], timeout: float) -> list[bytes]:
        return self._call("multi_get", generation, list(keys), timeout, timeout=timeout)

    def multi_set(self, generation: int, items: list[tuple[str, bytes]]) -> None:
        self._call("multi_set", generation, items)

    def wait(self, generation: int, keys: Iterable[str], timeout: float) -> None:
        self._call("wait", generation, list(keys), timeout, timeout=timeout)

    def wait_family(
        self, generation: int, prefix: str, count: int, timeout: float, put: tuple[str, bytes] | None = None
    ) -> list[bytes]:
        """The values of `prefix0` .. `prefix{count-1}`, waiting up to `timeout` s for all of them.

        `put`: a `(key, value)` written first, in the same call (see `KVStore.wait_family`).
        """
        (reply,) = self._call("wait_family", generation, prefix, count, timeout, put, timeout=timeout)
        return decode_family(reply)

    def add(self, generation: int, key: str, amount: int) -> int:
        return self._call("add", generation, key, amount)

    def compare_set(self, generation: int, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", generation, key, expected, desired)

    def check(self, generation: int, keys: Iterable[str]) -> bool:
        return self._call("check", generation, list(keys))

    def delete_key(self, generation: int, key: str) -> bool:
        return self._call("delete_key", generation, key)

    def num_keys(self, generation: int) -> int:
        return self._call("num_keys", generation)


def torch_store(client: KVClient, generation: int, timeout: float, world_size: int | None = None):
    """A `torch.distributed.Store` over the KV actor, scoped to `generation`.

    With `world_size`, per-rank keys are read for all ranks in one call (see
    `KVTorchStore`).
    """
    from ray_elastic.collective.torch_store import KVTorchStore

    return KVTorchStore(client, generation, timeout, world_size)
