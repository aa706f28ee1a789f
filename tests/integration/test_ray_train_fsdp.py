"""Ray Train's FSDP2 loop (support/fsdp_ray_train_loop.py) through a SIGKILL, on the session's two-node cluster.

Four workers, two per node, each `dcp.save`s its own shard file; rank 1
SIGKILLs itself mid-run. The survivors keep their processes, gather every
rank's files of the last report from their holders (rank 1's from its
replica on the other node), and `dcp.load` them resharded to the new world:
the state they resume from is bitwise the one reported. Every durable
checkpoint under `Result.path` holds every rank's files, and the last
sharded one, loaded by `dcp.load` at world 1 in this process, is bitwise the
full model the run ended with.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("ray.train")

from fsdp_ray_train_loop import Net, fit  # noqa: E402


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


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
    assert result.metrics.get("final") is True
    names = [os.path.basename(c.path) for c, _ in result.best_checkpoints]
    assert names[-1] == "full_model" and result.checkpoint.path == os.path.join(result.path, "full_model")
    sharded = [(c, m) for c, m in result.best_checkpoints if "size" in m]
    assert [m["step"] for _, m in sharded] == list(range(5, 41, 5)), names
    for checkpoint, metrics in sharded:
        files = set(os.listdir(checkpoint.path))
        expected = {".metadata"} | {f"__{r}_0.distcp" for r in range(metrics["size"])}
        assert files == expected, f"{checkpoint.path} at world {metrics['size']}: {sorted(files)}"
    assert not [n for n in os.listdir(result.path) if n.endswith(".partial")], os.listdir(result.path)

    # the last sharded checkpoint, resharded to world 1 by dcp.load, is bitwise the model the run ended with
    import torch.distributed.checkpoint as dcp

    final = torch.load(os.path.join(result.path, "full_model", "full-model.pt"))
    model = Net()
    state = {"app": {"model": model.state_dict()}}
    dcp.load(state, checkpoint_id=sharded[-1][0].path)
    loaded = state["app"]["model"]
    assert set(loaded) == set(final)
    for key, value in final.items():
        assert torch.equal(loaded[key], value), key
