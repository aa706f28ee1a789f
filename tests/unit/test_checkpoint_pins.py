"""A pinned checkpoint (Tune copying it) is kept by every writer while the pin lasts, whatever the nodes' clocks say.

The pin is written on one node (Tune's trial) and judged on another (rank
0's writer, when it prunes). Their wall clocks disagree; the pin lasts its
seconds on the writer's own monotonic clock from when it first sees it, so
an hour of skew either way neither drops a checkpoint being copied nor
keeps a dead pinner's pin for an hour. Clocks are passed in: no sleeps.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from ray_elastic.checkpoint import store as store_module
from ray_elastic.checkpoint.store import CheckpointStore

HOUR = 3600.0


class Nodes:
    """The wall clock each node's `time.time()` reads, and the writer's monotonic clock."""

    def __init__(self, monkeypatch) -> None:
        self.wall = 1_800_000_000.0
        self.skew = 0.0  # the writer's node's wall clock minus the reader's
        self.on_writer = False
        self.tick = 0.0  # the writer's monotonic clock
        monkeypatch.setattr(store_module, "time", SimpleNamespace(time=self.time, perf_counter=time.perf_counter))

    def time(self) -> float:
        return self.wall + (self.skew if self.on_writer else 0.0)

    def write(self, writer: CheckpointStore, commit: int) -> str:
        self.on_writer = True
        try:
            return writer.write({"step": commit}, {"generation": 1, "commit": commit})
        finally:
            self.on_writer = False


def stores(tmp_path, nodes: Nodes) -> tuple[CheckpointStore, CheckpointStore]:
    writer = CheckpointStore(str(tmp_path), keep=1, clock=lambda: nodes.tick)  # rank 0's node
    return writer, CheckpointStore(str(tmp_path), keep=1)  # Tune's trial, on another node


def test_a_writer_whose_clock_is_an_hour_ahead_keeps_a_pinned_checkpoint_while_it_is_copied(tmp_path, monkeypatch):
    nodes = Nodes(monkeypatch)
    nodes.skew = HOUR
    writer, reader = stores(tmp_path, nodes)
    copied = nodes.write(writer, 10)
    with reader.pinned(copied, 30):
        nodes.write(writer, 20)  # the writer prunes while Tune copies
        nodes.tick += 29
        nodes.wall += 29
        nodes.write(writer, 30)
        assert reader.read(copied)[0] == {"step": 10}, "the checkpoint being copied is still there"
    nodes.write(writer, 40)
    assert writer.checkpoints() and not writer.is_complete(copied), "unpinned, it is pruned at the next write"


def test_a_writer_whose_clock_is_an_hour_behind_lets_a_dead_pinners_pin_lapse_in_its_seconds(tmp_path, monkeypatch):
    nodes = Nodes(monkeypatch)
    nodes.skew = -HOUR
    writer, reader = stores(tmp_path, nodes)
    copied = nodes.write(writer, 10)
    killed = reader.pinned(copied, 30)  # held to the end: its exit would remove the pin
    killed.__enter__()  # the trial's process is killed while it copies: its pin is never removed
    nodes.write(writer, 20)
    assert writer.is_complete(copied), "pinned: kept"
    nodes.tick += 31
    nodes.wall += 31
    nodes.write(writer, 30)
    assert not writer.is_complete(copied), "31 s after the writer saw it, the 30 s pin has lapsed"
    assert [writer.read(p)[0] for p in writer.checkpoints()] == [{"step": 30}]
