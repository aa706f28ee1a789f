"""`torch.distributed.Store` backed by the run's KV actor.

Defined at module level inside the package: a Store subclass defined in
`__main__` or a closure cannot be shipped by Ray's cloudpickle (pybind11
metaclass conflict). Instances are built inside each worker, never shipped.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ray_elastic.rendezvous import KVClient


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class KVTorchStore(dist.Store):
    """Every operation is one bounded call to the KV actor for one generation."""

    def __init__(self, client: KVClient, generation: int, timeout: float) -> None:
        super().__init__()
        self._client = client
        self._generation = generation
        self._timeout_s = timeout

    def set(self, key: str, value: str | bytes) -> None:
        self._client.set(self._generation, key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._client.get(self._generation, key, self._timeout_s)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._client.multi_get(self._generation, keys, self._timeout_s)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._client.multi_set(self._generation, [(k, _as_bytes(v)) for k, v in zip(keys, values, strict=False)])

    def add(self, key: str, amount: int) -> int:
        return self._client.add(self._generation, key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._client.compare_set(self._generation, key, _as_bytes(expected), _as_bytes(desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = self._timeout_s if timeout is None else timeout.total_seconds()
        self._client.wait(self._generation, keys, seconds)

    def check(self, keys: list[str]) -> bool:
        return self._client.check(self._generation, keys)

    def delete_key(self, key: str) -> bool:
        return self._client.delete_key(self._generation, key)

    def num_keys(self) -> int:
        return self._client.num_keys(self._generation)

    # torch's C++ side (PrefixStore, which init_process_group wraps around us) calls these names
    deleteKey = delete_key  # noqa: N815
    getNumKeys = num_keys  # noqa: N815
