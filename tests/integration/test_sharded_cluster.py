"""An FSDP2 model in a `TorchState`, elastic in place on the session's multi-node cluster through `ElasticTrainer`.

One run (`support/sharded_workload.py`, min_workers=2, max_workers=4, hosts
of 2 slots) goes through every event the issue names, in order:

1. it starts at 2 on the first session node; a node is added to the
   cluster (2 CPUs) and to discovery: two newcomers join (world 4) and
   receive only their rows;
2. rank 1 SIGKILLs itself mid-run (world 3; its slot cools down);
3. the second session node is offered: a newcomer joins (world 4) and
   receives only its rows;
4. the added node is removed with its two workers (`cluster.remove_node`):
   world 2, every row of theirs from its replica on another node.

What a user would notice is asserted: survivors keep their processes; the
full state gathered right after each recovery is bitwise the last commit
before the event; the bytes moved are the planner's minimum; the ranks end
equal; the loss falls; `fit()` returns.
"""

from __future__ import annotations

import json

import pytest
from conftest import wait_until, written_lines
from runs import fit_in_thread
from sharded_workload import fsdp_train_fn
from workloads import FileDiscovery

from ray_elastic import ElasticTrainer

pytestmark = pytest.mark.integration


def _entries(log) -> list[dict]:
    return [json.loads(line) for line in written_lines(log)]


def _last_entry(log) -> dict | None:
    entries = _entries(log)
    return entries[-1] if entries else None


def _wait_world(log, size: int, what: str, fut, timeout: float = 60) -> dict:
    def reached() -> dict | bool:
        if fut.done():
            fut.result()  # fit() ended first: its error says why
            raise AssertionError(f"fit() returned before {what}")
        entry = _last_entry(log)
        return entry if entry is not None and entry["world_size"] == size else False

    return wait_until(reached, timeout, what, interval=0.1)


def test_fsdp2_state_reshards_in_place_through_a_sigkill_newcomers_and_a_node_loss(cluster, no_leaks, tmp_path):
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts_file = tmp_path / "hosts.json"
    hosts_file.write_text(json.dumps({first: 2}))
    log, kill, stop = tmp_path / "log.jsonl", tmp_path / "kill", tmp_path / "stop"
    config = {"log": str(log), "kill": str(kill), "stop": str(stop), "commit_every": 5, "extra_steps": 10}
    fut = fit_in_thread(
        ElasticTrainer(
            fsdp_train_fn,
            min_workers=2,
            max_workers=4,
            config=config,
            discovery=FileDiscovery(str(hosts_file)),
            cooldown_range=(60, 60),  # the victim's slot stays empty: the next newcomer comes from a new host
            verbose=0,
        )
    )
    added = None
    try:
        _wait_world(log, 2, "the run to start at 2", fut, timeout=90)
        added = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        hosts_file.write_text(json.dumps({first: 2, added.node_id: 2}))
        at_four = _wait_world(log, 4, "two newcomers on the added node", fut)
        kill.touch()
        _wait_world(log, 3, "the world of 3 after rank 1's SIGKILL", fut)
        hosts_file.write_text(json.dumps({first: 2, added.node_id: 2, second: 2}))
        _wait_world(log, 4, "a newcomer on the second node", fut)
        cluster.remove_node(added)
        added = None
        _wait_world(log, 2, "the world of 2 after the added node's loss", fut)
        stop.touch()
        result = fut.result(timeout=90)
    finally:
        if added is not None:
            cluster.remove_node(added)
    entries = _entries(log)
    assert [e["world_size"] for e in entries] == [2, 4, 3, 4, 2], entries
    assert at_four["ranks"][0]["node"] == first

    history = result.metrics_history
    commits = {m["commit"]: m["digest"] for m in history if "commit" in m}
    reported = [m for m in history if "entry" in m]
    assert [m["world_size"] for m in reported] == [2, 4, 3, 4, 2], reported
    for before, after in zip(reported, reported[1:], strict=False):
        # right after the reshard: bitwise the last commit before the event
        assert after["step"] in commits, (after["step"], sorted(commits))
        assert after["digest"] == commits[after["step"]], f"generation {after['entry']}: not the last commit's state"
        assert after["moved"] == after["minimum"], after
        # survivors keep their processes
        pids_before, pids_after = ({r["pid"] for r in m["ranks"]} for m in (before, after))
        smaller, larger = sorted((pids_before, pids_after), key=len)
        assert smaller <= larger, f"a survivor lost its process: {before['ranks']} -> {after['ranks']}"
        # newcomers receive exactly their rows of the new layout, not the whole model
        for rank in after["ranks"]:
            if rank["pid"] not in pids_before:
                assert rank["received"] == rank["shard"] > 0, rank
    four, four_again, two = reported[1], reported[3], reported[4]
    lost_node = four["ranks"][2]["node"]
    assert [r["node"] for r in four_again["ranks"]].count(lost_node) == 2, four_again["ranks"]
    assert lost_node not in {r["node"] for r in two["ranks"]}

    events = [e.kind for e in result.events]
    assert events.count("worker_failed") == 3 and events.count("hosts_added") == 2, result.events
    assert len(set(result.return_value["digests"])) == 1 and result.return_value["world_size"] == 2
    losses = [m["loss"] for m in history if "loss" in m]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), (losses[:5], losses[-5:])
