"""A Horovod Elastic script, unchanged but for its import line, through `ray-elastic run`.

`tests/support/horovod_scripts/elastic_train.py` is written as Horovod's elastic
examples are: `hvd.init()` at the top level, a `TorchState` holding the
model, the optimizer and an `ElasticSampler`, `state.commit()` every few
batches, a reset callback rescaling the learning rate with `hvd.size()`,
one `@hvd.elastic.run` function. The launcher runs it on the session's
cluster (2 nodes x 2 CPUs) with a discovery script, as horovodrun would,
through a SIGKILL, a host added and a host removed. The script logs what a
user would check: every sample trained exactly once per epoch (a count its
state holds, so a rollback rolls it back), the learning rate after every
reset and epoch, and each rank's final checksum.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import wait_until
from horovod_launch import SCRIPTS, launch

pytestmark = pytest.mark.integration

LR = 0.01
SAMPLES = 256


def records(log: Path) -> list[dict]:
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def test_a_horovod_elastic_script_lives_through_a_sigkill_a_host_added_and_a_host_removed(cluster, no_leaks, tmp_path):
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{first}:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    log, stop = tmp_path / "log.jsonl", tmp_path / "stop"
    argv = [
        str(SCRIPTS / "elastic_train.py"),
        *("-np", "2", "--min-np", "1", "--max-np", "4"),
        *("--host-discovery-script", str(discover), "--blacklist-cooldown-range", "1", "2"),
        *("--", "--log", str(log), "--stop-file", str(stop), "--lr", str(LR), "--samples", str(SAMPLES)),
        *("--kill-at", "1,3", "--kill-rank", "1"),
    ]
    proc = launch(cluster, argv)
    try:

        def epoch_end_after(predicate, index: int = 0):
            def check():
                if proc.poll() is not None:
                    raise AssertionError(f"the launcher ended early: {proc.returncode}")
                return any(r.get("event") == "epoch_end" and predicate(r) for r in records(log)[index:])

            return check

        def position(predicate) -> int:
            return next(i for i, r in enumerate(records(log)) if predicate(r))

        wait_until(lambda: any(r.get("event") == "kill" for r in records(log)), 120, "rank 1's SIGKILL in epoch 1")
        killed = position(lambda r: r.get("event") == "kill")
        # the dead worker's host cools down for 1-2 s, then a replacement brings the world back to 2
        wait_until(epoch_end_after(lambda r: r["size"] == 2, killed), 90, "the replacement's epochs at world 2")
        hosts.write_text(f"{first}:2\n{second}:2\n")
        wait_until(epoch_end_after(lambda r: r["size"] == 4, killed), 90, "the added host's epochs at world 4")
        grown = position(lambda r: r.get("event") == "epoch_end" and r["size"] == 4)
        hosts.write_text(f"{second}:2\n")
        wait_until(epoch_end_after(lambda r: r["size"] == 2, grown), 90, "the epochs at world 2 after the removal")
        stop.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (out + err)[-5000:]

    logged = records(log)
    epochs = [r for r in logged if r.get("event") == "epoch_end"]
    resets = [r for r in logged if r.get("event") == "reset"]
    assert {r["size"] for r in epochs} >= {2, 4}, [r["size"] for r in epochs]
    for r in epochs:
        # every sample once; the sampler pads the last batch of a rank with samples trained again
        assert r["trained_min"] == 1, r
        assert r["trained_total"] == SAMPLES + r["padding"], r
        assert r["processed"] == SAMPLES, r
        assert r["lr"] == pytest.approx(LR * r["size"]), r
    assert resets and all(r["lr"] == pytest.approx(LR * r["size"]) for r in resets), resets

    finished = re.findall(r"^\[(\d+)\]<stdout>:finished epoch (\d+) size (\d+) checksum (\S+)$", out, re.MULTILINE)
    assert finished, out[-3000:]
    sizes = {int(size) for _, _, size, _ in finished}
    assert sizes == {2} and len(finished) == 2, finished
    assert len({checksum for *_, checksum in finished}) == 1, f"ranks ended with different models: {finished}"
    kinds = re.findall(r"^  (\w+)\s+world size", out, re.MULTILINE)
    assert {"worker_failed", "hosts_added", "hosts_removed"} <= set(kinds), out[-3000:]
    print(f"events: {kinds}; {len(epochs)} epochs at world sizes {[r['size'] for r in epochs]}")
