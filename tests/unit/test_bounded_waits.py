"""Waits that end in bounded time with a typed error naming what they waited for (invariants 6 and 9; no cluster).

One test per wait that once had no deadline, or ended in an error that did
not say what it waited for; docs/internals.md lists every wait of the library.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

from ray_elastic.data import feed, shard
from ray_elastic.data.starvation import Probe, Starvation
from ray_elastic.exceptions import RendezvousTimeoutError


class _StalledDataset:
    """A dataset whose execution produces nothing until `go` is set, then ends."""

    def __init__(self) -> None:
        self.go = threading.Event()

    def iter_internal_ref_bundles(self):
        self.go.wait(30)
        return iter(())


def test_a_block_the_feed_never_produces_ends_the_ranks_wait_naming_the_block_and_the_dataset():
    dataset = _StalledDataset()
    epoch = feed._Epoch(
        "train", dataset, ahead=8, budget=1e9, starvation=Starvation(60.0, 1, probe=lambda: Probe(4.0, 0.0, 0))
    )
    started = time.monotonic()
    try:
        with pytest.raises(RendezvousTimeoutError, match=r"block 0 of dataset 'train' was not produced within 0.3 s"):
            epoch.blocks(0, wait_s=0.3)
    finally:
        dataset.go.set()
    assert time.monotonic() - started < 5


class _Remote:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return "a reference"


class _Feed:
    def __init__(self) -> None:
        self.blocks = _Remote()
        self.ref = _Remote()


def _never_answers(ref, timeout=None):
    raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")


def test_a_feed_that_does_not_answer_ends_the_shards_wait_naming_the_feed_and_the_dataset(monkeypatch):
    monkeypatch.setattr(ray, "get", _never_answers)
    data = shard.DataShard("train", _Feed())
    with pytest.raises(RendezvousTimeoutError) as e:
        data._ask_feed(0)
    assert "the feed actor's table of dataset 'train' from block 0 (epoch 0)" in str(e.value)
    assert f"{shard._WAIT_S + shard._ANSWER_MARGIN_S:g} s" in str(e.value)
    with pytest.raises(RendezvousTimeoutError, match="the feed actor's reference to block 3 of dataset 'train'"):
        data._block(3)


def test_a_block_the_object_store_does_not_deliver_ends_the_shards_wait_naming_it(monkeypatch):
    monkeypatch.setattr(ray, "get", _never_answers)
    data = shard.DataShard("train", _Feed())
    data._refs[2] = ("a block's reference", 0)
    with pytest.raises(RendezvousTimeoutError, match=r"block 2 of dataset 'train' \(epoch 0\) from the object store"):
        data._block(2)


def test_a_peer_whose_barrier_link_never_comes_ends_the_shared_ring_setup_naming_it(tmp_path, monkeypatch):
    from ray_elastic.collective import shm

    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    listener, _ = shm._listen(3)
    try:
        started = time.monotonic()
        expected = r"rank 0 waited 0.2 s \(collective_timeout\) for the barrier links of ranks \[1, 2\]"
        with pytest.raises(OSError, match=expected):
            shm._accept_higher(listener, rank=0, size=3, timeout_s=0.2)
        assert time.monotonic() - started < 5
    finally:
        listener.close()


def test_a_large_ring_reply_the_object_store_does_not_deliver_names_the_keys(monkeypatch):
    from ray_elastic.rendezvous import KVClient

    class KV:
        wait_family = _Remote()

    monkeypatch.setattr(KVClient, "_call", lambda self, *args, timeout: [ray.ObjectRef(b"\x01" * 28)])
    monkeypatch.setattr(ray, "get", _never_answers)
    expected = r"fetching keys addr/0..addr/3 of generation 7 from the object store took over 10 s"
    with pytest.raises(RendezvousTimeoutError, match=expected):
        KVClient(KV()).wait_family(7, "addr/", 4, timeout=5.0)


def _hangs(*args, **kwargs):
    time.sleep(3)


def test_storage_that_hangs_ends_rank_0s_resume_naming_the_checkpoint_and_the_option(tmp_path, monkeypatch):
    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.checkpoint import CheckpointError, CheckpointStore
    from ray_elastic.protocol import WorkerConfig
    from ray_elastic.runtime.checkpoint_cadence import CheckpointCadence

    monkeypatch.setattr(CheckpointStore, "read", _hangs)
    settings = WorkerConfig(checkpoint_dir=str(tmp_path), checkpoint_timeout=0.2)
    cadence = CheckpointCadence("w0", driver=None, settings=settings)
    rank0 = WorkerSlot("w0", "node", 0, 2, 0, 1, 0, 2)
    started = time.monotonic()
    expected = rf"reading the durable checkpoint in {tmp_path} \(checkpoint_timeout\) did not finish within 0.2 s"
    with pytest.raises(CheckpointError, match=expected):
        cadence.maybe_resume(state=None, slot=rank0, ever_synced=False)
    assert time.monotonic() - started < 2


def test_a_discovery_script_whose_escaped_child_holds_its_output_still_ends_in_bounded_time(tmp_path, monkeypatch):
    import os
    import signal

    from ray_elastic import discovery

    monkeypatch.setattr(discovery, "_REAP_S", 0.5)
    pidfile = tmp_path / "escaped.pid"
    script = tmp_path / "discover.sh"
    # the child leaves the script's session (the timeout's killpg misses it) and keeps its stdout open
    script.write_text(f"#!/bin/sh\nsetsid sleep 60 &\necho $! > {pidfile}\nsleep 60\n")
    script.chmod(0o755)
    source = discovery.ScriptDiscovery(str(script), {"CPU": 1.0}, timeout=0.3, nodes=lambda: [])
    started = time.monotonic()
    try:
        with pytest.raises(discovery.DiscoveryError, match="did not finish within 0.3 s"):
            source()
        assert time.monotonic() - started < 5
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
