"""A worker's runtime as far as `TorchState` asks it, over a ring a test builds itself (no Ray, no driver).

`RingRuntime(ring, host)`: the ring (`group`, `joined_ring()`), the
backend's name, this worker's host (`slot.host`: where a sharded state's
replicas go) and the run's lasting KV (a dict of this process's own).
"""

from __future__ import annotations

from types import SimpleNamespace


class RingRuntime:
    def __init__(self, ring=None, host: str | None = None, backend: str = "gloo") -> None:
        self.group = ring
        self.backend = backend
        self.slot = None if host is None else SimpleNamespace(host=host)
        self.lasting: dict[str, bytes] = {}

    def add_join_preparation(self, prepare) -> None:
        pass

    def post_lasting(self, key: str, value: bytes) -> None:
        self.lasting[key] = value

    def get_lasting(self, key: str) -> bytes | None:
        return self.lasting.get(key)

    def joined_ring(self):
        return self.group
