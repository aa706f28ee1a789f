"""Training across real, distinct IPs: worker nodes in network namespaces (tests/support/netns_cluster.py).

Each worker node has its own address on a bridge, so Gloo's rings cross a
network as on a real cluster, and a node can be cut off without a single
RST. The driver side of each run is a subprocess (tests/support/netns_fit.py): this
process may already be connected to the session's `cluster`. Skipped, with
the reason, where network namespaces cannot be created (not root).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_until, written_lines
from netns_cluster import NetnsCluster, unavailable_reason

from ray_elastic.checkpoint import CheckpointStore

pytestmark = pytest.mark.integration

FIT_SCRIPT = str(Path(__file__).parents[1] / "support" / "netns_fit.py")


@pytest.fixture(scope="module")
def netns_cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    c = NetnsCluster(num_nodes=2)
    try:
        yield c
    finally:
        c.close()


def start_fit(cluster: NetnsCluster, tmp_path: Path, config: dict, **trainer) -> subprocess.Popen:
    """Start `ElasticTrainer(counting_train_fn, ...).fit()` in a driver subprocess connected to `cluster`."""
    ip_dir = tmp_path / "ips"
    ip_dir.mkdir()
    trainer.setdefault("min_workers", 2)
    trainer.setdefault("max_workers", 4)
    spec = {"config": {**config, "ip_dir": str(ip_dir)}, "trainer": trainer}
    return subprocess.Popen(
        [sys.executable, FIT_SCRIPT, json.dumps(spec)],
        env=cluster.env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> dict:
    """The result the driver subprocess printed; fail with its stderr if it failed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the driver did not finish within {timeout:g} s: {err[-3000:]}")
    assert proc.returncode == 0, f"the driver failed ({proc.returncode}): {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def assert_same_state(result: dict) -> None:
    digests = result["return_value"]["digests"]
    assert len(digests) == result["return_value"]["world_size"]
    assert len(set(digests)) == 1, f"ranks diverged: {digests}"


def test_four_workers_on_two_ips_train_in_lockstep_and_a_sigkill_recovers_at_once(netns_cluster, tmp_path):
    """Four workers, two on each node's own address, train in lockstep across the bridge; then the victim's
    node sends FIN/RST across it: the survivors re-form without waiting out a timeout."""
    fault = {"rank": 1, "step": 15, "action": "sigkill", "marker": str(tmp_path / "fault")}
    # the victim's node is held back for the whole run, so the survivors go on at 3 and do not wait for a newcomer
    proc = start_fit(netns_cluster, tmp_path, {"steps": 60, "faults": [fault]}, cooldown_range=[60, 60])
    result = finish(proc, timeout=120)
    assert os.path.exists(fault["marker"])
    assert result["metrics"][0]["world_size"] == 4, "the ring of four trained before the kill"
    # the ring spanned both namespaces: two workers on each node's own address (no newcomer came after the kill)
    ips = sorted(result["worker_ips"].values())
    assert ips == sorted(netns_cluster.node_ips * 2), ips
    alive = {n["ip"] for n in result["nodes"] if n["alive"] and n["cpus"]}
    assert alive == set(netns_cluster.node_ips)
    [failed] = [e for e in result["events"] if e["kind"] == "worker_failed"]
    assert failed["reset_duration"] < 5, failed
    print(f"SIGKILL across namespaces: reset in {failed['reset_duration']:.2f} s")
    assert result["return_value"]["steps"] == 60 and result["return_value"]["world_size"] == 3
    assert_same_state(result)


def test_silent_cut_of_rank0s_node_survivors_go_on_in_seconds_and_the_healed_are_fenced(netns_cluster, tmp_path):
    """netem loss 100% (or blackhole) on rank 0's node: no RST. Default settings (collective_timeout=300 s).

    The driver declares the cut-off workers dead from its pings (their node's
    probe is silent too) and tells the survivors the ring is dead, which
    takes them out of their blocked collective. Then the network heals while
    the cut-off workers still run: they must not act for the run any more
    (metrics as rank 0, a durable checkpoint over the new rank 0's).
    """
    signal_file, after_cut = tmp_path / "signal", tmp_path / "after-cut"
    config = {
        "signal_file": str(signal_file),
        "signal_step": 20,
        "signal_world_size": 4,
        "world_signal_file": str(after_cut),
        "world_signal": 2,
        "until_world": 2,
        "min_steps": 21,  # the goal is training on the two survivors after the cut, not before
        "extra_steps": 60,
        "step_time": 0.05,
        "deadline_s": 150,
    }
    ckpt = tmp_path / "ckpt"
    # no newcomer on the healed node meanwhile (its cool-down outlasts the run): the world stays at 2
    proc = start_fit(
        netns_cluster,
        tmp_path,
        config,
        min_workers=2,
        checkpoint_dir=str(ckpt),
        checkpoint_every=1,
        cooldown_range=[600, 600],
    )
    try:
        wait_until(lambda: signal_file.exists() or proc.poll() is not None, 90, "rank 0 to reach step 20")
        assert proc.poll() is None, f"the driver ended early: {proc.communicate()[1][-3000:]}"
        rank0_ip = (tmp_path / "ips" / "w1").read_text()  # w1, the oldest, is rank 0 of generation 1
        [victim] = [n for n in netns_cluster.nodes if n.ip == rank0_ip]
        how = netns_cluster.cut(victim)
        cut_at = time.time()
        wait_until(lambda: after_cut.exists() or proc.poll() is not None, 60, "the survivors to train on their own")
        netns_cluster.heal(victim)  # the cut-off workers come back, with their old generation's state
        result = finish(proc, timeout=150)
    finally:
        netns_cluster.heal(victim)
    times = result["metric_times"]
    at_cut = [m for m, t in zip(result["metrics"], times, strict=True) if t < cut_at]
    assert at_cut[-1]["world_size"] == 4 and at_cut[-1]["rank0"] == "w1", "the cut should hit rank 0 in a world of 4"
    after = [m for m, t in zip(result["metrics"], times, strict=True) if t > cut_at]
    next_step_at = next(t for m, t in zip(result["metrics"], times, strict=True) if t > cut_at and m["world_size"] == 2)
    print(f"cut with {how}: the survivors' next step came {next_step_at - cut_at:.2f} s after the cut")
    assert next_step_at - cut_at < 30, "the survivors waited on their blocked collective (collective_timeout is 300 s)"
    victims = {w for w, ip in result["worker_ips"].items() if ip == victim.ip}
    assert not {m["rank0"] for m in after if m["world_size"] == 2} & victims, "a cut-off worker reported as rank 0"
    assert result["return_value"]["world_size"] == 2 and result["return_value"]["rank0"] not in victims
    assert_same_state(result)
    # the durable checkpoint is the new rank 0's, of the last generation: never overwritten by a healed one
    meta = CheckpointStore(str(ckpt)).meta()
    assert meta["generation"] == max(e["generation"] for e in result["events"]), meta


def _steps(log: Path) -> list[dict]:
    return [json.loads(line) for line in written_lines(log)]


def test_a_healed_partition_writes_nothing_of_the_dead_ring_into_the_survivors(netns_cluster, tmp_path):
    """`DistributedOptimizer` on 4 workers; the node without rank 0 is cut off silently, then healed mid-training.

    Before the fix (issue 34), 2.4 s after the heal the survivors' abandoned
    gradient allreduce completed into the bucket their next generation was
    using, and the cut-off workers completed one more step of the dead
    generation. Watched for 12 s after the heal: no work of the dead ring
    completes on a survivor, no cut-off worker completes a step after the
    heal, and the survivors' parameters are a replay of their own steps.
    """
    import torch
    from fenced_workload import replay

    logs, signal_file, stop_file = tmp_path / "logs", tmp_path / "signal", tmp_path / "stop"
    logs.mkdir()
    config = {
        "workload": "fenced",
        "log_dir": str(logs),
        "signal_file": str(signal_file),
        "signal_step": 20,
        "signal_world_size": 4,
        "stop_file": str(stop_file),
        "deadline_s": 170,
    }
    proc = start_fit(netns_cluster, tmp_path, config, min_workers=2, cooldown_range=[600, 600])
    victim = None
    try:
        wait_until(lambda: signal_file.exists() or proc.poll() is not None, 90, "rank 0 to reach step 20 with 4")
        assert proc.poll() is None, f"the driver ended early: {proc.communicate()[1][-3000:]}"
        [rank0] = [p.stem for p in logs.glob("w*.jsonl") if _steps(p) and _steps(p)[-1]["rank"] == 0]
        rank0_ip = (tmp_path / "ips" / rank0).read_text()
        [victim] = [n for n in netns_cluster.nodes if n.ip != rank0_ip]
        netns_cluster.cut(victim)
        cut_at = time.time()
        survivor_log = logs / f"{rank0}.jsonl"

        def trained_on_two(after: float) -> bool:
            return any(s["world"] == 2 and s["t"] > after for s in _steps(survivor_log))

        wait_until(lambda: trained_on_two(cut_at) or proc.poll() is not None, 60, "the survivors to train on two")
        netns_cluster.heal(victim)
        healed_at = time.time()
        # the defect showed 2.4 s after the heal: 12 s is five times that
        wait_until(
            lambda: trained_on_two(healed_at + 12) or proc.poll() is not None, 90, "12 s of training after the heal"
        )
        stop_file.touch()
        result = finish(proc, timeout=90)
    finally:
        if victim is not None:
            netns_cluster.heal(victim)
        stop_file.touch()
    victims = {w for w, ip in result["worker_ips"].items() if ip == victim.ip}
    late_steps = [s for w in victims for s in _steps(logs / f"{w}.jsonl") if s["t"] > healed_at]
    assert not late_steps, f"cut-off workers completed steps of the dead generation after the heal: {late_steps[:3]}"
    value = result["return_value"]
    assert value["world_size"] == 2 and value["rank0"] not in victims
    assert value["late_completions"] == [0, 0], "a collective of the abandoned ring completed on a survivor"
    assert len(set(value["digests"])) == 1, value["digests"]
    # the survivors' parameters are their own generation's steps replayed, with nothing of the dead ring's mixed in
    on_two = [s for s in _steps(logs / f"{value['rank0']}.jsonl") if s["world"] == 2]
    first = min(s["generation"] for s in on_two)
    start = torch.load(logs / f"start-g{first}.pt")
    steps = [s["step"] - 1 for s in on_two]  # a logged step is the state's count after it: it trained on step - 1
    assert steps[0] == start["step"], (steps[0], start["step"])
    expected = replay(start["model"], steps, 2)
    final = torch.load(logs / "final.pt")
    for name, tensor in expected.items():
        torch.testing.assert_close(
            final[name], tensor, rtol=1e-4, atol=1e-6, msg=f"{name} is no replay of the survivors' steps"
        )
    print(f"healed partition: {len(steps)} steps on two replayed, {len(victims)} cut-off workers silent after the heal")
