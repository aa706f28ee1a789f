"""An FSDP2 model in a `TorchState` resharded in place, on real Gloo rings of processes (no Ray).

Six processes run `tests/support/reshard_ranks.py`'s schedule: 4 ranks on two
hosts, then 4 -> 3 (a rank lost), 3 -> 4 (a newcomer with other weights),
4 -> 2 (a whole host lost with its two ranks), 2 -> 1, 1 -> 2 (a newcomer).
Every generation's state, gathered whole right after the reshard, must be
bitwise the previous generation's commit (parameters, AdamW's moments and
steps, the scheduler's learning rate), every rollback bitwise the commit,
and the bytes moved the planner's minimum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import reshard_ranks

SUPPORT = Path(__file__).resolve().parents[1] / "support" / "reshard_ranks.py"
DEADLINE_S = 240


@pytest.mark.parametrize("variant", ["fully_shard", "prepared"])
def test_fsdp2_state_reshards_in_place_through_losses_and_newcomers(tmp_path, variant) -> None:
    """`prepared`: prepare_model's policy, bf16 mixed precision, no reshard after forward, clipping, a GradScaler."""
    processes = sorted({p for world in reshard_ranks.WORLDS for p in world})
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = {
        p: subprocess.Popen(
            [sys.executable, str(SUPPORT), str(p), str(tmp_path), variant],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / f"{p}.err", "w"),  # noqa: SIM115 - closed with the process
        )
        for p in processes
    }
    deadline = time.monotonic() + DEADLINE_S
    try:
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            proc.kill()
    records = [json.loads(line) for p in processes for line in (tmp_path / f"{p}.jsonl").read_text().splitlines()]
    errors = {p: (tmp_path / f"{p}.err").read_text()[-2000:] for p in processes}
    synced = {(r["generation"], r["process"]): r for r in records if "after_sync" in r}
    restored = {(r["generation"], r["process"]): r["restored"] for r in records if "restored" in r}
    for generation, members in enumerate(reshard_ranks.WORLDS, start=1):
        for p in members:
            assert (generation, p) in synced, f"process {p} did not finish generation {generation}: {errors[p]}"
    before = None  # rank 0's record of the last generation that committed
    for generation, members in enumerate(reshard_ranks.WORLDS, start=1):
        rows = [synced[(generation, p)] for p in members]
        committed = before["committed"] if generation in reshard_ranks.UNCOMMITTED else rows[0]["committed"]
        assert len({r.get("committed", committed) for r in rows}) == 1, f"generation {generation}: commits differ"
        # in a generation that never committed, the buffers are the old world's: the rollback completes in the
        # next sync (which follows every rollback), checked there against the same commit
        assert generation in reshard_ranks.UNCOMMITTED or all(
            restored.get((generation, p), committed) == committed for p in members
        ), f"generation {generation}: a rollback did not bring the user's model and optimizer back to the commit"
        assert variant == "prepared" or all((generation, p) in restored for p in members), "restore() records"
        assert all(r["same_objects"] for r in rows)
        if generation > 1:
            _check_resumed(generation, rows, before)
        if generation not in reshard_ranks.UNCOMMITTED:
            before = rows[0]
    newcomer = synced[(3, 4)]
    assert 0 < newcomer["received"] < newcomer["moved"], "a newcomer receives its own rows, not the whole model"


def _check_resumed(generation: int, rows: list[dict], before: dict) -> None:
    """Every rank of `generation` holds, right after its sync, what `before`'s generation committed."""
    for r in rows:
        assert r["after_sync"] == before["committed"], (
            f"generation {generation}, rank {r['rank']}: the state after the reshard is not the last commit"
        )
        assert r["moved"] == r["minimum"], f"generation {generation}: moved {r['moved']} > minimum {r['minimum']}"
        if "step" in r:  # the plain state rolled back to the commit too, then 2 steps
            assert r["step"] == before["step"] + 2, "the plain state (step) did not roll back to the commit"


def _run_ranks(phase: str, world: int, directory: Path) -> list[dict]:
    script = SUPPORT.parent / "durable_shards.py"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), phase, str(r), str(world), str(directory)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            if out.strip():  # a rank the scenario loses prints nothing
                outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return outs


def test_a_durable_sharded_checkpoint_is_every_ranks_dcp_files_and_resumes_at_another_world(tmp_path) -> None:
    """Written at 2 ranks in DCP's format; a new run of 3 resumes from it; dcp.load reads it whole in one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from durable_shards import full_digest

    written = _run_ranks("write", 2, tmp_path)
    files = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    resumed = _run_ranks("resume", 3, tmp_path)
    assert {r["digest"] for r in resumed} == {written[0]["digest"]}, "the resumed run does not hold the checkpoint"
    assert {r["step"] for r in resumed} == {3}
    model = reshard_ranks.build_plain()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "sharded"))
    assert full_digest(state["model"]) == written[0]["model"], "dcp.load at world 1 is not the model written"
    assert all(isinstance(t, torch.Tensor) for t in state["model"].values())


def test_ranks_that_shard_the_model_differently_are_refused_by_name_on_every_rank(tmp_path) -> None:
    outs = _run_ranks("mismatch", 2, tmp_path)
    for out in outs:
        assert out["error"] is not None and out["error"].startswith("ShardingRefused: ranks [1] shard the model"), out


def test_rows_lost_with_their_replica_fall_back_to_the_newest_durable_checkpoint_within_the_run(tmp_path) -> None:
    """Two ranks that keep each other's replicas are lost at once: the survivors go back to the durable commit 2."""
    outs = _run_ranks("lost", 4, tmp_path)
    assert [o["process"] for o in outs] == [0, 2]
    for out in outs:
        assert out["after"] == out["commits"][1], "not the newest durable commit (commit 2 of 3)"
        assert out["step"] == 2
        assert out["commit_count"] == 2, "survivors count commits from the checkpoint's"
    (reason,) = outs[0]["told"]  # the event rank 0 gave the driver says why the disk was read
    assert "resharding lost rows" in reason and ("old rank 1" in reason or "old rank 3" in reason), reason
