"""Who may write rank 0's durable checkpoint: the fence asked before every write, without Ray.

A rank 0 cut off from the run and replaced must never write (invariant 10:
a stale writer cannot write a checkpoint). A rank 0 still in the run must:
a newer generation published with it still rank 0 (a newcomer admitted
while its last checkpoint was being written) does not make it stale. The KV
actor here is the real `KVServer` logic, run on an event loop in place of Ray.
"""

from __future__ import annotations

import asyncio

import ray_elastic as elastic
from ray_elastic.assignment import WorkerSlot
from ray_elastic.checkpoint import CheckpointStore
from ray_elastic.kv_server import KVServer
from ray_elastic.protocol import WorkerConfig
from ray_elastic.runtime.checkpoint_cadence import CheckpointCadence


class LocalKV:
    """`KVClient`'s calls that the fence makes, answered by a `KVServer` on a private event loop."""

    def __init__(self) -> None:
        self.server = KVServer("run")
        self.loop = asyncio.new_event_loop()

    def publish(self, generation: int, plan: dict[str, WorkerSlot]) -> None:
        self.loop.run_until_complete(self.server.publish(generation, plan))

    def current_generation(self, timeout: float = 10.0) -> int:
        return self.loop.run_until_complete(self.server.current_generation())

    def wait_generation(self, after: int, timeout: float, worker_id: str | None = None):
        return self.loop.run_until_complete(self.server.wait_generation(after, timeout, worker_id))


def plan(*worker_ids: str) -> dict[str, WorkerSlot]:
    size = len(worker_ids)
    return {w: WorkerSlot(w, "node", rank, size, rank, size, 0, 1) for rank, w in enumerate(worker_ids)}


def rank0_of(kv: LocalKV, tmp_path, generation: int, *members: str) -> tuple[CheckpointCadence, WorkerSlot]:
    """w1, rank 0 of `generation` (published with `members`), with a checkpoint every commit."""
    kv.publish(generation, plan(*members))
    settings = WorkerConfig(checkpoint_dir=str(tmp_path), checkpoint_every=1, checkpoint_timeout=10.0)
    cadence = CheckpointCadence("w1", driver=None, settings=settings, kv=kv)  # type: ignore[arg-type]
    return cadence, plan(*members)["w1"]


def test_rank0_still_rank0_of_a_newer_generation_writes_its_final_checkpoint(tmp_path):
    kv = LocalKV()
    cadence, slot = rank0_of(kv, tmp_path, 3, "w1", "w2")
    kv.publish(4, plan("w1", "w2", "w3"))  # a newcomer admitted: w1 is still rank 0
    cadence.after_commit(elastic.ObjectState(step=120), slot, generation=3, commits=120)
    assert cadence.flush() is None, "rank 0 is still a member: its final checkpoint is durable"
    entries, meta = CheckpointStore(str(tmp_path)).read(allow_pickle=True)
    assert (meta["generation"], meta["commit"]) == (3, 120)


def test_rank0_left_out_of_the_newer_generation_writes_nothing(tmp_path):
    kv = LocalKV()
    cadence, slot = rank0_of(kv, tmp_path, 3, "w1", "w2")
    kv.publish(4, plan("w2", "w3"))  # w1 was cut off and replaced
    cadence.after_commit(elastic.ObjectState(step=120), slot, generation=3, commits=120)
    note = cadence.flush()
    assert note is not None and "w1 is not a member of generation 4" in note
    assert CheckpointStore(str(tmp_path)).read() is None, "a worker let go never writes"


def test_a_member_no_longer_rank0_of_the_newer_generation_writes_nothing(tmp_path):
    kv = LocalKV()
    cadence, slot = rank0_of(kv, tmp_path, 3, "w1", "w2")
    kv.publish(4, plan("w2", "w1"))  # the checkpoints are w2's to write now
    cadence.after_commit(elastic.ObjectState(step=120), slot, generation=3, commits=120)
    note = cadence.flush()
    assert note is not None and "rank 1 of generation 4, not rank 0" in note
    assert CheckpointStore(str(tmp_path)).read() is None


def test_rank0_of_the_current_generation_writes(tmp_path):
    kv = LocalKV()
    cadence, slot = rank0_of(kv, tmp_path, 3, "w1", "w2")
    cadence.after_commit(elastic.ObjectState(step=120), slot, generation=3, commits=120)
    assert cadence.flush() is None
    assert CheckpointStore(str(tmp_path)).read(allow_pickle=True)[1]["commit"] == 120
