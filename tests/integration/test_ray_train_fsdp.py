"""Ray Train's FSDP2 loop (support/fsdp_ray_train_loop.py) on the session's two-node cluster, elastic in place.

Workers, two per node, each `dcp.save` their own shard file. Two runs:

- rank 1 SIGKILLs itself mid-run (world 4, `num_workers=(2, 4)`);
- a node is added (world 4 grows to 6: two newcomers there), then that node
  is removed (`cluster.remove_node`) with its two workers once a report of
  the world of 6 is committed: world 4 again.

Through each, the survivors keep their processes, gather every rank's files
of the last report from their live holders (a lost rank's from its replica
on another node), and `dcp.load` them resharded to the new world: the state
they resume from is bitwise the one reported. Every durable checkpoint
under `Result.path` holds every rank's files, and the last sharded one,
loaded by `dcp.load` at world 1 in this process, is bitwise the full model
the run ended with.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future

import pytest
import torch
from conftest import wait_until, written_lines

pytest.importorskip("ray.train")

from fsdp_ray_train_loop import Net, fit  # noqa: E402


def _records(path) -> list[dict]:
    return [json.loads(line) for line in written_lines(path)]


def _check_durable_checkpoints(result, report_steps: list[int]) -> None:
    """Every sharded checkpoint holds every rank's files; the last, at world 1, is bitwise the run's final model."""
    import torch.distributed.checkpoint as dcp

    assert result.metrics.get("final") is True
    names = [os.path.basename(c.path) for c, _ in result.best_checkpoints]
    assert names[-1] == "full_model" and result.checkpoint.path == os.path.join(result.path, "full_model")
    sharded = [(c, m) for c, m in result.best_checkpoints if "size" in m]
    assert [m["step"] for _, m in sharded] == report_steps, names
    for checkpoint, metrics in sharded:
        files = set(os.listdir(checkpoint.path))
        expected = {".metadata"} | {f"__{r}_0.distcp" for r in range(metrics["size"])}
        assert files == expected, f"{checkpoint.path} at world {metrics['size']}: {sorted(files)}"
    assert not [n for n in os.listdir(result.path) if n.endswith(".partial")], os.listdir(result.path)

    final = torch.load(os.path.join(result.path, "full_model", "full-model.pt"))
    model = Net()
    state = {"app": {"model": model.state_dict()}}
    dcp.load(state, checkpoint_id=sharded[-1][0].path)
    loaded = state["app"]["model"]
    assert set(loaded) == set(final)
    for key, value in final.items():
        assert torch.equal(loaded[key], value), key


def test_ray_trains_fsdp2_loop_recovers_in_place_and_its_checkpoints_reshard(cluster, no_leaks, tmp_path):
    log, marker = tmp_path / "log.jsonl", tmp_path / "killed"
    config = {
        "lr": 0.01,
        "steps": 40,
        "batch_size": 8,
        "report_every": 5,
        "step_sleep": 0.05,
        "log": str(log),
        "kill": {"rank": 1, "step": 12, "marker": str(marker)},
    }
    result = fit(config, num_workers=(2, 4), storage_path=str(tmp_path / "runs"))
    records = _records(log)
    killed_at = float(marker.read_text())
    entries = [r for r in records if r.get("entry")]
    before = {r["pid"] for r in entries if r["time"] < killed_at}
    after = [r for r in entries if r["time"] > killed_at]
    assert len(before) == 4, f"four workers started: {entries}"
    survivors = before & {r["pid"] for r in after}
    assert len(survivors) == 3, f"the three survivors re-entered in their own processes: {entries}"

    # the state every re-entry resumed from is bitwise the one reported at that step
    reported = {r["report"]: r["checksum"] for r in records if "report" in r}
    resumed = [r for r in after if r["rank"] == 0]
    assert resumed and all(r["at"] in reported for r in resumed), (resumed, sorted(reported))
    for r in resumed:
        assert r["checksum"] == reported[r["at"]], f"resumed at step {r['at']} from another state than reported"
    first_step = min(r["time"] for r in records if "step" in r and r["time"] > killed_at and r["pid"] in survivors)
    print(f"SIGKILL to a survivor's next step: {first_step - killed_at:.2f} s")

    # the durable checkpoints: every rank's files, each a plain directory under Result.path
    _check_durable_checkpoints(result, list(range(5, 41, 5)))


def _fit_in_thread(config: dict, **kwargs) -> Future:
    fut: Future = Future()

    def target() -> None:
        try:
            fut.set_result(fit(config, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the test
            fut.set_exception(e)

    threading.Thread(target=target, daemon=True).start()
    return fut


def _worker_log_lines(run_id: str) -> list[str]:
    """What the run's workers logged (`ray_elastic`'s logger, in the Ray session's logs; see session_log.py)."""
    from ray_elastic.session_log import session_log_dir

    directory = session_log_dir()
    assert directory is not None and os.path.isdir(directory), directory
    lines = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(f"worker-{run_id}-"):
            with open(os.path.join(directory, name), errors="replace") as f:
                lines += f.readlines()
    return lines


def test_ray_trains_fsdp2_loop_grows_onto_an_added_node_and_survives_that_nodes_loss(cluster, no_leaks, tmp_path):
    log, until = tmp_path / "log.jsonl", tmp_path / "until"
    config = {
        "lr": 0.01,
        "steps": 20,
        "batch_size": 8,
        "report_every": 5,
        "step_sleep": 0.05,
        "log": str(log),
        "until": str(until),  # past step 20, the loop goes on until the test is through
    }
    fut = _fit_in_thread(config, num_workers=(2, 6), storage_path=str(tmp_path / "runs"))

    def reached(predicate, what: str, timeout: float = 90) -> None:
        def check() -> bool:
            if fut.done():
                fut.result()  # fit() ended first: its error says why
                raise AssertionError(f"fit() returned before {what}")
            return any(predicate(r) for r in _records(log))

        wait_until(check, timeout, what, interval=0.1)

    added = None
    try:
        reached(lambda r: r.get("report") and r["size"] == 4, "a report at world 4")
        added = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        reached(lambda r: r.get("report") and r["size"] == 6, "a report at world 6, with the added node's workers")
        grown = next(r["report"] for r in _records(log) if r.get("report") and r["size"] == 6)
        # rank 0's step past that report: every rank committed it (the report's last barrier)
        reached(lambda r: r.get("step", 0) > grown and r["rank"] == 0 and r["size"] == 6, "the report committed")
        lost_at = time.time()
        cluster.remove_node(added)
        added = None
        reached(lambda r: r.get("entry") and r["size"] == 4 and r["time"] > lost_at, "world 4 after the node's loss")
        until.touch()
        result = fut.result(timeout=120)
    finally:
        if added is not None:
            cluster.remove_node(added)
    records = _records(log)
    entries = [r for r in records if r.get("entry")]
    sizes = []
    for r in entries:
        if not sizes or sizes[-1] != r["size"]:
            sizes.append(r["size"])
    # the two newcomers join together, or one generation after the other (a world of 5 between)
    assert sizes in ([4, 6, 4], [4, 5, 6, 4]), entries

    first = {r["pid"]: r["node"] for r in entries if r["size"] == 4 and r["time"] < lost_at and r["at"] == 0}
    six = {r["pid"]: r["node"] for r in entries if r["size"] == 6}
    last = {r["pid"]: r["node"] for r in entries if r["size"] == 4 and r["time"] > lost_at}
    assert len(first) == 4 and len(set(first.values())) == 2, f"four workers on the session's two nodes: {entries}"
    newcomers = set(six) - set(first)
    assert set(first) <= set(six) and len(newcomers) == 2, f"the four kept their processes, two joined: {entries}"
    lost_node = {six[p] for p in newcomers}
    assert len(lost_node) == 1 and lost_node.isdisjoint(first.values()), f"the newcomers on the added node: {six}"
    assert set(last) == set(first), f"the four on the session's nodes re-entered in their own processes: {entries}"

    # the state every re-entry resumed from is bitwise the one reported at that step
    reported = {r["report"]: (r["checksum"], r["size"]) for r in records if "report" in r}
    resumed = [r for r in entries if r["rank"] == 0 and r.get("checksum") is not None]
    assert [r["size"] for r in resumed] == sizes[1:], resumed
    for r in resumed:
        assert r["checksum"] == reported[r["at"]][0], f"resumed at step {r['at']} from another state than reported"
    at_six, after_loss = resumed[-2:]
    assert reported[at_six["at"]][1] in (4, 5), "the world of 6 resumed from the last report of the world before"
    assert after_loss["at"] >= grown and reported[after_loss["at"]][1] == 6, (
        "the world of 4 resumed from a report of the world of 6, resharded 6 -> 4"
    )
    # the lost node's files came from their replicas on the session's nodes: nothing was read from storage_path
    # (report_store logs each part it reads from a durable directory; the survivors' logs of the loss are there)
    lines = _worker_log_lines(result.elastic.run_id)
    assert sum("the ring broke" in line for line in lines) >= 4, lines
    assert not [line for line in lines if f"read from {result.path}" in line]

    # ranks equal at the end, and the loss fell
    ends = [r for r in records if r.get("end")]
    assert sorted(r["rank"] for r in ends) == [0, 1, 2, 3] and {r["size"] for r in ends} == {4}, ends
    assert len({r["checksum"] for r in ends}) == 1, ends
    losses = [r["loss"] for r in records if "loss" in r and r["rank"] == 0]
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5]), (losses[:5], losses[-5:])

    events = [e.kind for e in result.elastic.events]
    assert events.count("hosts_added") >= 1 and events.count("worker_failed") == 2, result.elastic.events
    end = ends[0]["at"]
    _check_durable_checkpoints(result, list(range(5, end + 1, 5)))
