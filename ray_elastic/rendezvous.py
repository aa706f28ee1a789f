"""Rendezvous: one named key-value actor per trainer run, and the workers' client of it.

The actor runs `kv_server.KVServer` (generation-scoped keys, server-side
waits: see that module), which is plain asyncio; this module puts it on Ray.
Every key lives in a generation (one generation per reset round), so keys of
generation g are never read by generation g+1, and a wait for a key of an old
generation fails with `GenerationSupersededError` as soon as a newer one is
published. All waits happen inside the actor; clients never poll.

The driver publishes each generation's assignment here; workers block in
`wait_generation` for the next one and get back only their own slot. A
generation's traffic is O(N) calls, two per rank: `wait_generation`, then one
`wait_family` call that writes the rank's address and fetches every peer's
(Gloo's full mesh would otherwise read the N addresses one key at a time,
2N^2 calls).
`KVClient` is the synchronous view used inside worker processes;
`collective.torch_store` adapts it to a `torch.distributed.Store`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.auth import Authed, RunToken, with_token_check
from ray_elastic.exceptions import CoordinatorDiedError, RendezvousTimeoutError
from ray_elastic.kv_server import KVServer, unpack_family

if TYPE_CHECKING:
    from collections.abc import Iterable

# extra seconds a client waits for the actor's own bounded answer
_CLIENT_MARGIN_S = 10.0
# a family's packed values up to this size go back inside each reply; larger ones by object reference
# (under Ray's 100 KiB limit for values returned inline)
_INLINE_FAMILY_BYTES = 64 * 1024


def share_family(packed: bytes) -> bytes | ray.ObjectRef:
    """A family's packed values (`kv_server.pack_family`) as one reply for every rank: inline, or by reference.

    Gloo's addresses compress several-fold, so for a thousand ranks the reply
    still goes back inline. Against handing every rank an object reference
    (which makes each reader a borrower the actor has to track), that costs
    the actor far less CPU per call when a thousand ranks ask at once.
    """
    return packed if len(packed) <= _INLINE_FAMILY_BYTES else ray.put(packed)


def decode_family(
    reply: bytes | ray.ObjectRef, timeout: float = _CLIENT_MARGIN_S, what: str = "a family of values"
) -> list[bytes]:
    """The values of a family reply (fetching them first if they came by reference); `what` names them."""
    if isinstance(reply, ray.ObjectRef):
        try:
            reply = ray.get(reply, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RendezvousTimeoutError(f"fetching {what} from the object store took over {timeout:g} s") from None
    return unpack_family(reply)


class KVStore(KVServer):
    """The KV actor (`create_kv_actor` wraps it with `ray.remote`): large family replies go by reference."""

    def share_reply(self, packed: bytes) -> bytes | ray.ObjectRef:
        return share_family(packed)

    @ray.method(max_task_retries=0)  # every other call is retried across a restart; this one must fail on a death
    async def hold(self) -> None:
        await super().hold()


def create_kv_actor(run_id: str, namespace: str, token: RunToken, scheduling_strategy: Any = None) -> Authed:
    """Start the run's KV actor, named `kv` in the run's own namespace; it answers only calls carrying `token`.

    Ray restarts it if its process dies (`max_restarts=-1`), and calls made
    meanwhile wait for the new instance (`max_task_retries=-1`); the driver
    then tells it the current generation (`restore`).
    """
    actor_cls = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(
        with_token_check(KVStore, exempt=("share_reply",))
    )
    handle = actor_cls.options(
        name="kv", namespace=namespace, max_concurrency=100_000, scheduling_strategy=scheduling_strategy
    ).remote(token, run_id)
    return Authed(handle, token)


class KVClient:
    """Synchronous access to the KV actor from a worker process.

    Every call is bounded: the actor bounds its own waits and the client adds
    a margin for the round trip, so no call blocks without a deadline.
    """

    def __init__(self, handle: Authed) -> None:
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

    def post(self, generation: int, key: str, value: bytes) -> None:
        """`set` without waiting for it (this caller's later calls still come after it); dropped if stale."""
        self.handle.note.remote(generation, key, value)

    def get(self, generation: int, key: str, timeout: float) -> bytes:
        return self._call("get", generation, key, timeout, timeout=timeout)

    def post_lasting(self, key: str, value: bytes) -> None:
        """Write a key of no generation (it outlives resets), without waiting for it."""
        self.handle.set_lasting.remote(key, value)

    def get_lasting(self, key: str, timeout: float = 10.0) -> bytes | None:
        return self._call("get_lasting", key, timeout=timeout)

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
        return decode_family(reply, what=f"keys {prefix}0..{prefix}{count - 1} of generation {generation}")

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

    def current_generation(self, timeout: float = 10.0) -> int:
        return self._call("current_generation", timeout=timeout)
