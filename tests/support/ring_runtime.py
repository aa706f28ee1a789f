"""A worker's runtime as far as `TorchState` asks it, over a ring a test builds itself (no Ray, no driver).

`RingRuntime(ring, host)`: the ring (`group`, set by the test; `joined()`
and `generation_now()` hand it out as generation 1), the backend's name,
this worker's host (`slot.host`: where a sharded state's replicas go) and
the run's lasting KV (a dict of this process's own).
With `checkpoints` (a `CheckpointCadence`), rank 0 can fall back to the newest
durable checkpoint within the run, as a worker's runtime does.
"""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import torch.distributed as dist

from ray_elastic.runtime.generation import Generation


class RingRuntime:
    def __init__(self, ring=None, host: str | None = None, backend: str = "gloo", checkpoints=None) -> None:
        self.group = ring
        self.backend = backend
        self.slot = None if host is None else SimpleNamespace(host=host, rank=0, size=1)
        self.lasting: dict[str, bytes] = {}
        self.checkpoints = checkpoints
        self.commits = 0  # the run's commit count, as a worker's runtime keeps it

    def after_commit(self, state, save_seconds: float) -> None:
        self.commits += 1
        if self.checkpoints is not None:
            self.checkpoints.after_commit(state, self.slot, generation=1, commits=self.commits)

    def check_host_updates(self) -> None:
        pass  # no driver: hosts never change here

    def fall_back_to_durable(self, generation, state, reason: str) -> bool:
        meta = None if self.checkpoints is None else self.checkpoints.load_newest(state, generation.slot, reason)
        if meta is not None:
            self.commits = meta["commit"]
        return meta is not None

    def add_join_preparation(self, prepare) -> None:
        pass

    def post_lasting(self, key: str, value: bytes) -> None:
        self.lasting[key] = value

    def get_lasting(self, key: str) -> bytes | None:
        return self.lasting.get(key)

    def joined(self) -> Generation:
        return Generation(1, self.slot, self.group)

    def generation_now(self) -> Generation | None:
        return None if self.group is None else self.joined()


def file_store(path: str, world: int, timeout_s: float = 60.0) -> dist.FileStore:
    """A ring's rendezvous in a file the test's processes share.

    Not a TCP port picked ahead: a port found free when the test starts can be
    taken, before a later generation binds it, by any process's outgoing
    connection (the OS hands ephemeral ports from the same range); CI lost a
    run to EADDRINUSE so. One file per ring.
    """
    store = dist.FileStore(path, world)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store
