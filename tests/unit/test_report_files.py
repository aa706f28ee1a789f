"""A report's checkpoint files across ranks: the combining rule, the replica choice, and the store on a thread ring.

The store's test runs ranks as threads of this process over a ring of
queues: FSDP2-like reports (each rank its own shard file, rank 0 also
`.metadata`) through the loss of one node, and a DDP-like report (rank 0's
files only) that survivors keep whole.
"""

from __future__ import annotations

import os
import queue
import threading

import numpy as np
import pytest

from ray_elastic.collective.base import CollectiveGroup, CollectiveWork
from ray_elastic.train.report_files import (
    combine,
    keepers,
    kept_whole,
    manifest,
    pack,
    replica_ranks,
    sources,
    unpack,
)
from ray_elastic.train.report_store import ReportStore

DEADLINE_S = 20.0


def _dcp_like(rank: int) -> dict[str, bytes]:
    files = {f"__{rank}_0.distcp": bytes([rank]) * (100 + rank)}
    if rank == 0:
        files[".metadata"] = b"meta"
    return files


# ---- the combining rule ---------------------------------------------------------------------
def test_every_ranks_own_files_are_parts_of_one_checkpoint():
    parts, conflicts = combine([manifest(_dcp_like(r)) for r in range(3)])
    assert conflicts == []
    assert [p["owner"] for p in parts] == [0, 1, 2]
    assert [name for name, _, _ in parts[0]["files"]] == [".metadata", "__0_0.distcp"]
    assert not kept_whole({"index": 1, "parts": parts, "directory": None})


def test_a_file_passed_by_several_ranks_is_kept_once_from_the_lowest_and_differing_contents_are_named():
    same = {"model.pt": b"weights"}
    parts, conflicts = combine([None, manifest(same), manifest(same), manifest({"model.pt": b"other", "x": b"1"})])
    assert [(p["owner"], [n for n, _, _ in p["files"]]) for p in parts] == [(1, ["model.pt"]), (3, ["x"])]
    assert conflicts == [("model.pt", [1, 3])]


def test_a_checkpoint_from_rank_0_alone_or_identical_on_every_rank_is_one_part_kept_whole():
    for manifests in ([manifest({"model.pt": b"w"}), None, None], [manifest({"model.pt": b"w"})] * 3):
        parts, conflicts = combine(manifests)
        assert len(parts) == 1 and parts[0]["owner"] == 0 and not conflicts
        layout = {"index": 1, "parts": parts, "directory": None}
        assert kept_whole(layout) and keepers(layout, ["a", "a", "b"]) == [{0, 1, 2}]


# ---- the replica choice ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (["a", "a", "b", "b"], [2, 3, 0, 1]),  # the same local rank on the next node: one replica each
        (["a", "a", "b", "b", "c", "c"], [2, 3, 4, 5, 0, 1]),
        (["a", "a", "a", "b"], [3, 3, 3, 0]),  # unequal nodes: the next rank round the ring on another node
        (["a", "a", "b"], [2, 2, 0]),
        (["a", "a", "a"], [1, 2, 0]),  # one node: the next rank
        (["a"], [0]),
    ],
)
def test_a_replica_goes_to_another_node_where_the_run_has_one(hosts, expected):
    replicas = replica_ranks(hosts)
    assert replicas == expected
    for rank, replica in enumerate(replicas):
        if len(set(hosts)) > 1:
            assert hosts[replica] != hosts[rank]
        elif len(hosts) > 1:
            assert replica != rank


def test_after_a_reset_each_part_has_two_keepers_on_two_nodes_and_the_lowest_holder_sends_it():
    parts, _ = combine([manifest(_dcp_like(r)) for r in range(4)])
    layout = {"index": 3, "parts": parts, "directory": None}
    stay = keepers(layout, ["a", "b", "b"])
    assert stay == [{0, 1}, {1, 0}, {2, 0}, {0, 2}]
    assert sources(layout, [[0, 1], [], [1, 3]]) == [0, 0, None, 2]


def test_a_part_travels_as_one_buffer_and_is_checked_on_arrival():
    files = _dcp_like(0)
    (part,), _ = combine([manifest(files)])
    assert unpack(pack(files, part), part) == files
    blob = pack(files, part)
    blob[0] ^= 1
    with pytest.raises(ValueError, match="other contents"):
        unpack(blob, part)
    with pytest.raises(ValueError, match="bytes"):
        unpack(blob[:-1], part)


# ---- the store, on a ring of threads ----------------------------------------------------------
class _Hub:
    def __init__(self, size: int) -> None:
        self.size = size
        self.queues = {(s, r): queue.Queue() for s in range(size) for r in range(size)}
        self.barrier = threading.Barrier(size, timeout=DEADLINE_S)
        self.slots: list = [None] * size
        self.sent_bytes = 0


class _Ring(CollectiveGroup):
    """Just the collectives the store uses, between threads."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        super().__init__(rank, hub.size)
        self.hub = hub

    def send_async(self, value, dst):
        self.hub.sent_bytes += value.numel()
        self.hub.queues[(self.rank, dst)].put(value.clone())
        return CollectiveWork()

    def recv_async(self, value, src):
        def wait() -> None:
            value.copy_(self.hub.queues[(src, self.rank)].get(timeout=DEADLINE_S))

        return CollectiveWork("receive", wait)

    def allgather_object(self, obj):
        self.hub.slots[self.rank] = obj
        self.hub.barrier.wait()
        out = list(self.hub.slots)
        self.hub.barrier.wait()
        return out

    def broadcast_object(self, obj, root_rank=0):
        gathered = self.allgather_object(obj)
        if root_rank != self.rank:
            self.hub.sent_bytes += len(gathered[root_rank] or b"")
        return gathered[root_rank]

    def barrier(self) -> None:
        self.hub.barrier.wait()

    def allreduce_(self, value, op=None):
        raise NotImplementedError

    def broadcast_(self, value, root_rank=0):
        raise NotImplementedError

    def allgather(self, value):
        raise NotImplementedError

    def close(self) -> None:
        pass


def _on_ranks(jobs) -> tuple[list, _Hub]:
    hub = _Hub(len(jobs))
    results: list = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = jobs[rank](_Ring(hub, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S * 2)
    assert not errors, errors
    return results, hub


def test_sharded_report_survives_a_nodes_loss_and_every_survivor_gets_every_file(tmp_path):
    hosts = ["a", "a", "b", "b"]
    stores = [ReportStore(str(tmp_path)) for _ in hosts]
    layouts, hub = _on_ranks(
        [lambda ring, r=r: stores[r].report(ring, _dcp_like(r), 1, hosts[r], "checkpoint_000001", 1) for r in range(4)]
    )
    layout = layouts[0]
    assert all(other == layout for other in layouts) and layout["directory"] == "checkpoint_000001"
    # each rank holds its own part and its replica's (the same local rank on the other node)
    assert [sorted(owner for _, owner in s.parts) for s in stores] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert hub.sent_bytes == sum(len(b) for r in range(4) for b in _dcp_like(r).values())  # each part once
    everything = {name: data for r in range(4) for name, data in _dcp_like(r).items()}
    durable = tmp_path / "checkpoint_000001"
    assert {p.name: p.read_bytes() for p in durable.iterdir()} == everything
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_000001"]  # no staging directory left

    # node "a" (ranks 0 and 1) is lost; the survivors are ranks 0 and 1 of a world of 2, with a newcomer on "c"
    survivors = [stores[2], stores[3], ReportStore(str(tmp_path))]
    new_hosts = ["b", "b", "c"]
    gathered, _ = _on_ranks([lambda ring, r=r: survivors[r].settle(ring, layout, new_hosts[r]) for r in range(3)])
    assert all(files == everything for files in gathered)
    assert sorted(owner for s in survivors for _, owner in s.parts) == [0, 0, 1, 1, 2, 2, 3, 3]
    # every part on both nodes: the newcomer, alone on "c", keeps one copy of all four
    assert [len(s.parts) for s in survivors] == [2, 2, 4]


def test_a_part_no_live_worker_holds_is_read_from_the_durable_copy(tmp_path, caplog):
    hosts = ["a", "b"]
    stores = [ReportStore(str(tmp_path)) for _ in hosts]
    layouts, _ = _on_ranks(
        [lambda ring, r=r: stores[r].report(ring, _dcp_like(r), 4, hosts[r], "c4", 2) for r in (0, 1)]
    )
    with caplog.at_level("WARNING", logger="ray_elastic.train.report_store"):
        (files,), _ = _on_ranks([lambda ring: ReportStore(str(tmp_path)).settle(ring, layouts[0], "z")])
    assert files == {**_dcp_like(0), **_dcp_like(1)}
    # the line a cluster test looks for in the workers' logs to tell that nothing was read from storage
    assert sum(f"read from {tmp_path / 'c4'}" in m for m in caplog.messages) == 2, caplog.messages
    os.remove(tmp_path / "c4" / "__1_0.distcp")
    with pytest.raises(AssertionError, match="CheckpointError"):
        _on_ranks([lambda ring: ReportStore(str(tmp_path)).settle(ring, layouts[0], "z")])


def test_a_torn_reports_staging_directory_goes_once_its_name_is_reported_again(tmp_path):
    # generation 1's try of "c1" was cut by a failure after one owner staged its files
    (tmp_path / ".c1.g1.partial").mkdir()
    (tmp_path / ".c1.g1.partial" / "__1_0.distcp").write_bytes(b"torn")
    (tmp_path / ".c10.g1.partial").mkdir()  # another name's: not this report's to remove
    stores = [ReportStore(str(tmp_path)) for _ in range(2)]
    _on_ranks([lambda ring, r=r: stores[r].report(ring, _dcp_like(r), 1, "ab"[r], "c1", 2) for r in (0, 1)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c10.g1.partial", "c1"]
    assert {p.name for p in (tmp_path / "c1").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}


def test_a_report_from_rank_0_alone_is_kept_whole_and_survivors_move_nothing(tmp_path):
    stores = [ReportStore(None) for _ in range(3)]
    model = {"model.pt": np.arange(50, dtype=np.float32).tobytes()}
    layouts, _ = _on_ranks(
        [lambda ring, r=r: stores[r].report(ring, model if r == 0 else None, 1, "a", "x", 1) for r in range(3)]
    )
    assert layouts[0]["directory"] is None and all(s.local_files(layouts[0]) == model for s in stores)
    moved, hub = _on_ranks([lambda ring, r=r: stores[r + 1].settle(ring, layouts[0], "a") for r in range(2)])
    assert moved == [None, None] and hub.sent_bytes == 0
    assert all(s.local_files(layouts[0]) == model for s in stores[1:])


def test_older_reports_are_dropped_once_every_rank_committed_the_next():
    stores = [ReportStore(None) for _ in range(2)]
    for index in (1, 2):
        _on_ranks([lambda ring, r=r, i=index: stores[r].report(ring, _dcp_like(r), i, "ab"[r], "d", 1) for r in (0, 1)])
    assert {i for s in stores for i, _ in s.parts} == {1, 2}
    _on_ranks([lambda ring, r=r: stores[r].committed(ring, 2, []) for r in (0, 1)])
    assert {i for s in stores for i, _ in s.parts} == {2}
    assert (
        stores[0].held_bytes() == stores[1].held_bytes() == sum(len(b) for r in (0, 1) for b in _dcp_like(r).values())
    )
