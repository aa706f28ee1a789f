"""Hot spares (`spares=1`) on a real local cluster: a member's SIGKILL is filled by a spare booted before it, in the
first generation after the death; a spare whose node is lost and a spare that hangs are replaced and never join.

One run goes through all three (each boot costs seconds on two cores). Discovery is a file, so the test decides
which node has room for a spare: the members fill node A, spares go to the nodes the test adds.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import wait_until
from runs import fit_in_thread
from spare_loop import booted, gone, new_boot, spare_train_fn, steps
from workloads import FileDiscovery

from ray_elastic import ElasticTrainer

pytestmark = pytest.mark.integration


def test_a_spare_fills_a_killed_members_place_at_once_and_lost_or_hung_spares_never_join(cluster, no_leaks, tmp_path):
    a = cluster.worker_nodes_at_start[0].node_id
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({a: 2}))
    fut = fit_in_thread(
        ElasticTrainer(
            spare_train_fn,
            min_workers=2,
            max_workers=2,
            config={"dir": str(tmp_path)},
            discovery=FileDiscovery(str(hosts)),
            spares=1,
            cooldown_range=(1, 1),
            liveness_timeout=2.0,
            verbose=0,
        )
    )
    added = []
    try:
        wait_until(lambda: len({s["pid"] for s in steps(tmp_path)}) == 2 or fut.done(), 120, "2 members to train")
        members = {s["pid"] for s in steps(tmp_path)}
        assert len(members) == 2, fut.result() if fut.done() else members
        assert set(booted(tmp_path)) == members, "node A is full with the members: no room for a spare"

        # a node with room: a spare boots there; the node is lost, and the spare with it
        added.append(cluster.add_node(num_cpus=1))
        hosts.write_text(json.dumps({a: 2, added[0].node_id: 1}))
        lost_spare = new_boot(tmp_path, members, "a spare to boot on the added node")
        cluster.remove_node(added.pop())
        hosts.write_text(json.dumps({a: 2}))
        wait_until(lambda: gone(lost_spare), 30, "the lost node's spare to be gone")

        # another node: a spare boots there before the kill, and takes the dead member's place
        added.append(cluster.add_node(num_cpus=1))
        hosts.write_text(json.dumps({a: 2, added[0].node_id: 1}))
        spare = new_boot(tmp_path, members | {lost_spare}, "a spare to boot on the second added node")
        generation = max(s["generation"] for s in steps(tmp_path))
        victim = min(members)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: any(s["generation"] > generation for s in steps(tmp_path)), 60, "a step after the kill")
        first = min(s["generation"] for s in steps(tmp_path) if s["generation"] > generation)

        def first_ring() -> set[int]:
            return {s["pid"] for s in steps(tmp_path) if s["generation"] == first}

        wait_until(lambda: len(first_ring()) >= 2, 30, f"both ranks of generation {first} to step")
        assert first_ring() == (members - {victim}) | {spare}, "the first generation after the death has the spare"
        assert booted(tmp_path)[spare] < killed_at, "the spare's boot was not on the critical path"
        back = min(s["time"] for s in steps(tmp_path) if s["generation"] == first and s["pid"] == spare)
        print(f"\nback at full strength {back - killed_at:.2f} s after the SIGKILL (first step of the spare)")

        # the replacement spare (on A, after its 1 s cool-down) hangs: it is killed, never joins, and replaced
        hung = new_boot(tmp_path, members | {lost_spare, spare}, "a new spare after the promotion")
        os.kill(hung, signal.SIGSTOP)
        wait_until(lambda: gone(hung), 30, "the hung spare to be killed")
        new_boot(tmp_path, members | {lost_spare, spare, hung}, "a spare to replace the hung one")
        (tmp_path / "stop").touch()
        result = fut.result(timeout=120)
    finally:
        for node in added:
            cluster.remove_node(node)
    trained = steps(tmp_path)
    assert {s["size"] for s in trained} == {2}, "the world never trained short-handed"
    assert {lost_spare, hung}.isdisjoint(s["pid"] for s in trained), "a lost or hung spare joined a ring"
    assert result.spares_promoted == 1
    promoted = [e for e in result.events if e.kind == "spare_promoted"]
    assert len(promoted) == 1 and promoted[0].generation == first and promoted[0].reset_duration is not None
    failed = [e.detail for e in result.events if e.kind == "newcomer_failed"]
    assert any(d.startswith("hot spare worker") and "its node is gone" in d for d in failed), failed
    assert any(d.startswith("hot spare worker") and "hung" in d for d in failed), failed
    assert [e.kind for e in result.events].count("worker_failed") == 1
