"""`torch.distributed.Store` backed by the run's KV actor (`torch_store()` builds one).

Defined at module level inside the package: a Store subclass defined in
`__main__` or a closure cannot be shipped by Ray's cloudpickle (pybind11
metaclass conflict). Instances are built inside each worker, never shipped.

Gloo's full mesh makes each rank write its address under `<prefix>/<rank>`
and then wait for and read every rank's address one key at a time: 2N^2
calls per ring. Given the world size, the store reads such a per-rank key's
whole family in one bounded call (`wait_family`, which returns once all N
exist) and serves the rest from memory. The write of the rank's own per-rank
key is held back and sent inside that same call, so a ring costs each rank
one call; it is sent on its own before any other operation, so a write is
never held back past something that could depend on it. Those keys are
written once per ring (a generation's store is never reused), which is what
makes the local copy safe; any other key goes to the actor on every call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from datetime import timedelta

    from ray_elastic.rendezvous import KVClient


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class KVTorchStore(dist.Store):
    """Every operation is one bounded call to the KV actor for one generation.

    `world_size` (optional) turns on the one-call read of per-rank keys
    `<prefix>/<r>`, r < world_size, described in the module docstring. Only
    for a backend whose every rank writes its own such key before reading
    the others' (Gloo): a key that one rank writes for all (NCCL's unique id)
    would be waited on with the rest of its "family" never written.
    """

    def __init__(self, client: KVClient, generation: int, timeout: float, world_size: int | None = None) -> None:
        super().__init__()
        self._client = client
        self._generation = generation
        self._timeout_s = timeout
        self._world_size = world_size or 0  # 0: no per-rank families
        self._per_rank: dict[str, bytes] = {}
        self._held: tuple[str, bytes] | None = None  # a per-rank key's write, sent with the next family read

    def _family(self, key: str) -> str | None:
        """`<prefix>/` if `key` is `<prefix>/<rank>` with rank < world size, else None."""
        prefix, sep, last = key.rpartition("/")
        if self._world_size and sep and last.isdigit() and int(last) < self._world_size:
            return prefix + sep
        return None

    def _send_held(self) -> None:
        """Send a held-back write on its own (before any operation other than its family's read)."""
        if self._held is not None:
            key, value = self._held
            self._held = None
            self._client.set(self._generation, key, value)

    def _fetch_family(self, prefix: str, timeout: float) -> None:
        put = None
        if self._held is not None and self._family(self._held[0]) == prefix:
            put, self._held = self._held, None
        self._send_held()
        values = self._client.wait_family(self._generation, prefix, self._world_size, timeout, put)
        self._per_rank.update((f"{prefix}{i}", v) for i, v in enumerate(values))

    def set(self, key: str, value: str | bytes) -> None:
        self._per_rank.pop(key, None)
        self._send_held()
        if self._family(key) is not None:
            self._held = (key, _as_bytes(value))
            return
        self._client.set(self._generation, key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        if key not in self._per_rank:
            family = self._family(key)
            if family is None:
                self._send_held()
                return self._client.get(self._generation, key, self._timeout_s)
            self._fetch_family(family, self._timeout_s)
        return self._per_rank[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._send_held()
        return self._client.multi_get(self._generation, keys, self._timeout_s)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._send_held()
        self._client.multi_set(self._generation, [(k, _as_bytes(v)) for k, v in zip(keys, values, strict=False)])

    def add(self, key: str, amount: int) -> int:
        self._send_held()
        return self._client.add(self._generation, key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        self._send_held()
        return self._client.compare_set(self._generation, key, _as_bytes(expected), _as_bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        missing = [k for k in keys if k not in self._per_rank]
        if not missing:
            return
        families = {self._family(k) for k in missing}
        prefixes = {f for f in families if f is not None}
        if prefixes != families:  # a key outside every per-rank family: the actor waits for them all
            self._send_held()
            self._client.wait(self._generation, missing, seconds)
            return
        for prefix in prefixes:
            self._fetch_family(prefix, seconds)

    def check(self, keys: list[str]) -> bool:
        self._send_held()
        return self._client.check(self._generation, keys)

    def delete_key(self, key: str) -> bool:
        self._send_held()
        return self._client.delete_key(self._generation, key)

    def num_keys(self) -> int:
        self._send_held()
        return self._client.num_keys(self._generation)

    # torch's C++ side (PrefixStore, which init_process_group wraps around us) calls these names
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815


def torch_store(client: KVClient, generation: int, timeout: float, world_size: int | None = None) -> KVTorchStore:
    """A `torch.distributed.Store` over the KV actor, scoped to `generation`.

    With `world_size`, per-rank keys are read for all ranks in one call (see
    `KVTorchStore`).
    """
    return KVTorchStore(client, generation, timeout, world_size)
