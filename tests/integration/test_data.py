"""Ray Data input: a parquet dataset trained exactly once per epoch through a SIGKILL, a join and a leave.

Every rank appends to a ledger (one JSON line per step: generation, step,
epoch, the row ids it trained) and, right after each sync, the step it
resumed from; the soak's `check_ledger` drops what rollbacks undid, and
what is left must cover every row of every epoch once, apart from the
padding of an epoch's last step.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_until
from runs import fit_in_thread
from soak import check_ledger, ledger_writer
from workloads import _fire_faults

import ray_elastic as elastic

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ray_data = pytest.importorskip("ray.data")

pytestmark = pytest.mark.integration

ROWS_PER_FILE = 10_000


def write_parquet(directory: Path, files: int, rows_per_file: int = ROWS_PER_FILE, pad_bytes: int = 0) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        ids = np.arange(f * rows_per_file, (f + 1) * rows_per_file, dtype=np.int64)
        columns = {"id": ids, "x": (ids % 97).astype(np.float32) / 97}
        if pad_bytes:
            columns["pad"] = [b"\0" * pad_bytes] * rows_per_file
        pq.write_table(pa.table(columns), directory / f"part-{f:03d}.parquet")
    return files * rows_per_file


def ledger_train_fn(config: dict) -> dict:
    import torch

    from ray_elastic.runtime.process import current

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    shard = elastic.get_dataset_shard("train", shuffle=True, seed=7)
    state = elastic.torch.TorchState(model=model, optimizer=opt, data=shard, epoch=0, step=0)
    write = ledger_writer(config["ledger_dir"])

    @elastic.run
    def train(state) -> dict:
        gen = current().generation
        write({"sync": gen, "step": state.step})
        while True:
            shard.set_epoch(state.epoch)
            for batch in shard.iter_torch_batches(batch_size=config["batch_size"]):
                opt.zero_grad()
                loss = ((model(batch["x"].unsqueeze(1)) - 1.0) ** 2).mean()
                loss.backward()
                opt.step()
                state.step += 1
                write({"gen": gen, "step": state.step, "epoch": state.epoch, "idx": batch["id"].tolist()})
                _fire_faults(config, state.step)
                elastic.report({"step": state.step, "world_size": elastic.size()})
                if elastic.rank() == 0 and state.step >= config.get("signal_step", 10**9):
                    Path(config["signal_file"]).touch()
                if config.get("world_file") and elastic.rank() == 0:
                    Path(config["world_file"]).write_text(str(elastic.size()))
                time.sleep(config.get("step_time", 0.02))
                if state.step % 5 == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            state.epoch += 1
            state.commit()
            # the test says when the membership changes are done; every rank stops at the same epoch
            if elastic.broadcast_object(Path(config["stop_file"]).exists()):
                break
        return {
            "epochs": state.epoch,
            "padding": shard.padding_rows,
            "digests": elastic.allgather_object(float(model.weight.detach()[0, 0])),
        }

    return train(state)


def test_a_parquet_dataset_is_trained_exactly_once_through_a_kill_a_join_and_a_leave(cluster, no_leaks, tmp_path):
    n = write_parquet(tmp_path / "data", files=6)  # 120 batches of 500 an epoch: the events are step-driven
    host_a, host_b = (node.node_id for node in cluster.worker_nodes_at_start)
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({host_a: 2, host_b: 1}))
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    config = {
        "stop_file": str(tmp_path / "stop"),
        "batch_size": 500,
        "ledger_dir": str(ledger_dir),
        "faults": [{"rank": 1, "step": 12, "action": "sigkill", "marker": str(tmp_path / "killed")}],
        "signal_file": str(tmp_path / "go"),
        "signal_step": 30,
        "world_file": str(tmp_path / "world"),
    }

    def discover() -> dict:
        return json.loads(hosts.read_text())

    ds = ray_data.read_parquet(str(tmp_path / "data"))
    fut = fit_in_thread(
        elastic.ElasticTrainer(
            ledger_train_fn,
            min_workers=1,
            max_workers=4,
            config=config,
            datasets={"train": ds},
            discovery=discover,
            resources_per_worker={"CPU": 0.5},  # leaves CPUs for Ray Data's read tasks
            cooldown_range=(60, 60),  # the killed worker's slot stays empty: only the join brings one back
            verbose=0,
        )
    )
    world = tmp_path / "world"
    wait_until(lambda: (tmp_path / "go").exists() or fut.done(), 120, "step 30, after the SIGKILL")
    hosts.write_text(json.dumps({host_a: 2, host_b: 2}))  # a node's slot joins
    wait_until(lambda: world.exists() and world.read_text() == "3" or fut.done(), 90, "the newcomer to join")
    hosts.write_text(json.dumps({host_b: 2}))  # host A leaves gracefully (its workers hand the state over)
    wait_until(lambda: world.read_text() == "2" or fut.done(), 90, "host A's workers to leave")
    (tmp_path / "stop").touch()  # train to the end of the epoch under way, then stop
    result = fut.result(timeout=240)
    kinds = [e.kind for e in result.events]
    assert "worker_failed" in kinds and "hosts_added" in kinds and "hosts_removed" in kinds, result.events
    epochs = result.return_value["epochs"]
    assert epochs >= 2 and len(set(result.return_value["digests"])) == 1, result.return_value
    max_world = max(m["world_size"] for m in result.metrics_history)
    figures = check_ledger(str(ledger_dir), n, epochs=epochs, max_world=max_world)  # the soak's: by row id here
    assert figures["samples_checked"] >= epochs * n
    assert figures["rolled_back_lines"] > 0, "the SIGKILL rolled some steps back, and they were trained again"


def bad_input_train_fn(config: dict) -> None:
    elastic.get_dataset_shard("validation")


def test_bad_datasets_fail_before_anything_starts(cluster, no_leaks, tmp_path):
    write_parquet(tmp_path / "data", files=1, rows_per_file=10)
    ds = ray_data.read_parquet(str(tmp_path / "data"))
    with pytest.raises(ValueError, match=r"datasets\['train'\] must be a ray.data.Dataset"):
        elastic.ElasticTrainer(ledger_train_fn, 1, 1, datasets={"train": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"asks get_dataset_shard for \['validation'\].*datasets \['train'\]"):
        elastic.ElasticTrainer(bad_input_train_fn, 1, 1, datasets={"train": ds})
    with pytest.raises(ValueError, match=r"asks get_dataset_shard for \['train'\].*no datasets="):
        elastic.ElasticTrainer(ledger_train_fn, 1, 1)


STREAM_SCRIPT = """
import json, sys, time
import ray, ray.data
import ray_elastic as elastic
ray.init(address="local", num_cpus=4, object_store_memory={store}, include_dashboard=False)

def train_fn(config):
    shard = elastic.get_dataset_shard("train")
    state = elastic.ObjectState(data=shard, rows=0, ids_sum=0)

    @elastic.run
    def train(state):
        for batch in shard.iter_batches(batch_size=1000):
            state.rows += len(batch["id"])
            state.ids_sum += int(batch["id"].sum())
            state.commit()
        rows = elastic.allgather_object(state.rows)
        return {{"rows": sum(rows), "padding": shard.padding_rows, "size": elastic.size()}}

    return train(state)

ray.data.DataContext.get_current().target_max_block_size = 4 * 2**20  # blocks of 4 MB, as with small files
ds = ray.data.read_parquet({path!r})
result = elastic.ElasticTrainer(train_fn, 2, 2, datasets={{"train": ds}}, verbose=0).fit()
from ray._private.internal_api import memory_summary
print("RESULT", json.dumps(result.return_value))
summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
print("MEMORY", summary.replace(chr(10), " | "))
"""


def test_a_dataset_larger_than_the_object_store_streams_through_it(tmp_path):
    """Its own Ray, with a 100 MB object store, and 1.6 times that in parquet (16 files of 10 MB): no materialize()."""
    n = write_parquet(tmp_path / "data", files=16, rows_per_file=1000, pad_bytes=10_000)
    script = tmp_path / "stream.py"
    script.write_text(STREAM_SCRIPT.format(store=100 * 2**20, path=str(tmp_path / "data")))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=280, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    value = json.loads(done.stdout.split("RESULT", 1)[1].splitlines()[0])
    assert value["size"] == 2 and value["rows"] - value["padding"] == n, value
    # what went through the object store (and whether Ray spilled some of it to disk), for the record
    print(done.stdout.split("MEMORY", 1)[1][:2000])


def epoch_ids_train_fn(config: dict) -> dict:
    """Every rank's row ids of each epoch, gathered at its end; no model: the data path alone."""
    shard = elastic.get_dataset_shard("train")
    state = elastic.ObjectState(data=shard, epoch=0)

    @elastic.run
    def train(state) -> dict:
        epochs = []
        while state.epoch < config["epochs"]:
            shard.set_epoch(state.epoch)
            ids = []
            for batch in shard.iter_batches(batch_size=100):
                ids += batch["id"].tolist()
                state.commit()
            epochs.append({"ids": sum(elastic.allgather_object(ids), []), "padding": shard.padding_rows})
            state.epoch += 1
        return {"epochs": epochs, "world_size": elastic.size()}

    return train(state)


def test_a_run_whose_workers_would_take_every_cpu_keeps_one_for_ray_data(cluster, no_leaks, tmp_path, caplog):
    """Two nodes of 2 CPUs, max_workers=4: measured, 0 batches in 10 minutes before data_cpus existed."""
    n = write_parquet(tmp_path / "data", files=8, rows_per_file=250)
    ds = ray_data.read_parquet(str(tmp_path / "data"))
    with caplog.at_level(logging.INFO, logger="ray_elastic"):
        result = elastic.ElasticTrainer(
            epoch_ids_train_fn, min_workers=2, max_workers=4, config={"epochs": 1}, datasets={"train": ds}
        ).fit()
    assert "keeping 1 CPU(s) of the cluster free for Ray Data's read and map tasks (data_cpus=1" in caplog.text
    assert "3 worker slot(s) of the 4 the cluster holds" in caplog.text
    assert result.return_value["world_size"] == 3
    for epoch in result.return_value["epochs"]:
        ids = epoch["ids"]
        assert sorted(set(ids)) == list(range(n)) and len(ids) == n + epoch["padding"], "every row once per epoch"


def test_a_slow_block_is_reported_as_slow_not_starved_and_the_epoch_ends_exactly(cluster, no_leaks, tmp_path):
    """data_cpus=1: the pipeline's own task holds the CPU it was left, so none is free, yet nothing is starved.

    The starvation timeout is 5 s here and the block takes 8 s (the issue's 60 s and 70 s, scaled down).
    """
    n = write_parquet(tmp_path / "data", files=8, rows_per_file=250)

    def slow_on_file_3(batch: dict) -> dict:  # defined here, so it travels by value to Ray Data's tasks
        if 750 in batch["id"]:  # the map of one block (rows 750..999) takes 8 s, on the CPU left for data
            time.sleep(8)
        return batch

    ds = ray_data.read_parquet(str(tmp_path / "data"), override_num_blocks=8).map_batches(slow_on_file_3)
    result = elastic.ElasticTrainer(
        epoch_ids_train_fn,
        min_workers=2,
        max_workers=3,
        config={"epochs": 1},
        datasets={"train": ds},
        data_starvation_timeout=5,
        verbose=0,
    ).fit()
    [epoch] = result.return_value["epochs"]
    assert sorted(set(epoch["ids"])) == list(range(n)) and len(epoch["ids"]) == n + epoch["padding"]
    slow = [e for e in result.events if e.kind == "data_slow"]  # the pipeline's start may be slow here too
    assert slow, [(e.kind, e.detail) for e in result.events]
    for event in slow:
        assert "of dataset 'train' took" in event.detail and "slow, not starved" in event.detail, event.detail
        assert float(event.detail.split(" took ")[1].split(" s")[0]) >= 5, event.detail


def test_the_starvation_probe_counts_its_own_clusters_tasks_whatever_address_file_the_machine_holds(cluster, tmp_path):
    """The last `ray start`'s address file names a stopped cluster (a port where no GCS listens), as one left on a
    machine where other clusters ran: the probe's count of running tasks still comes from the cluster it runs on
    (it counts the asking task itself once Ray has its record, within about a second), each probe at once. The file
    is in a temp dir of the test's own (`RAY_TMPDIR`)."""
    import ray

    from ray_elastic.data.starvation import running_tasks

    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")

    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"RAY_TMPDIR": str(tmp_path)}})
    def count_with_a_stale_address_file() -> tuple[list[int | None], float]:
        counts: list[int | None] = []
        slowest, deadline = 0.0, time.monotonic() + 30
        while time.monotonic() < deadline and (not counts or counts[-1] == 0):  # until it counts, or cannot
            started = time.monotonic()
            counts.append(running_tasks(since_ms=time.time() * 1000 - 60_000))
            slowest = max(slowest, time.monotonic() - started)
            time.sleep(0.1)
        return counts, slowest

    counts, slowest = ray.get(count_with_a_stale_address_file.remote(), timeout=120)
    assert counts[-1] is not None and counts[-1] >= 1, f"the probe could not count this cluster's tasks: {counts}"
    assert slowest < 10, f"a probe took {slowest:.1f} s"


def test_a_dataset_starved_of_cpus_fails_the_run_naming_the_cause_and_the_option(cluster, no_leaks, tmp_path):
    """data_cpus=0 gives the 4 workers every CPU: Ray Data's read tasks cannot start, and the run says so."""
    write_parquet(tmp_path / "data", files=16, rows_per_file=250)
    ds = ray_data.read_parquet(str(tmp_path / "data"))
    trainer = elastic.ElasticTrainer(
        epoch_ids_train_fn,
        min_workers=4,
        max_workers=4,
        config={"epochs": 1},
        datasets={"train": ds},
        data_cpus=0,
        data_starvation_timeout=5,
        verbose=0,
    )
    started = time.monotonic()
    with pytest.raises(elastic.TrainingFailedError) as failed:
        trainer.fit()
    took = time.monotonic() - started
    message = str(failed.value)
    assert "DataStarvedError" in message and "while the cluster had no free CPU" in message, message
    assert "data_cpus=0" in message and "data_starvation_timeout" in message, message
    # bounded, where Ray Data's own guard waits 30 minutes: ~15 s here. (The probe once asked the state API without
    # an address, which after other test clusters had stopped waited 40 s per probe for a stopped one's GCS: ~90 s.)
    assert took < 60, f"the starved run took {took:.0f} s to fail: {message}"
