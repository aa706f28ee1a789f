"""Ray Data input: rows/s of our shard against Ray Train's `get_dataset_shard`, and the resume after a kill.

On a local cluster (a head without CPUs and two 2-CPU nodes), the same
parquet dataset (`--files` files of `--rows` rows: an int64 id, 8 float32
features and a 1 KB binary column) is read by 2 workers of 0.5 CPU each
(the rest is left to Ray Data's read tasks), one epoch after a warm-up
epoch, with `iter_batches(batch_size=--batch)` and nothing else per batch:

- `elastic`: `ElasticTrainer(datasets={"train": ds})`, `get_dataset_shard`;
- `raytrain`: Ray Train v2's `TorchTrainer(datasets={"train": ds})`,
  `ray.train.get_dataset_shard`.

Rounds alternate between the two (`--rounds`); rows/s is the whole world's
rows of the timed epoch over rank 0's wall time for it. Then the resume:
`elastic` with rank 1 SIGKILLed mid-epoch (a third 0.5-CPU worker keeps the
world at 2): the survivors' time from the kill to their next batch, the
rows handed out again (the rollback to the last commit: every 5 batches)
and whether the feed executed the epoch again (it must not: the blocks
since the last commit are still held).

Prints a table and writes bench/results/data.json. Reports, never asserts.

    .venv/bin/python bench/data.py [--rounds 3] [--files 20] [--rows 10000] [--batch 256]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.data
from own_dashboard import local_cluster
from results_file import write_results

import ray_elastic as elastic


def write_dataset(directory: Path, files: int, rows: int) -> int:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for f in range(files):
        ids = np.arange(f * rows, (f + 1) * rows, dtype=np.int64)
        table = {"id": ids, **{f"f{i}": rng.random(rows, dtype=np.float32) for i in range(8)}}
        table["blob"] = [b"\1" * 1024] * rows
        pq.write_table(pa.table(table), directory / f"part-{f:03d}.parquet")
    return files * rows


def elastic_train_fn(config: dict) -> dict:
    shard = elastic.get_dataset_shard("train")
    state = elastic.ObjectState(data=shard, epoch=0, batches=0)
    marks: dict = {}

    @elastic.run
    def train(state) -> dict:
        while state.epoch < 2:
            shard.set_epoch(state.epoch)
            began = time.perf_counter()
            rows = 0
            for batch in shard.iter_batches(batch_size=config["batch"]):
                rows += len(batch["id"])
                state.batches += 1
                if "kill_at" in config and state.epoch == 1 and state.batches == config["kill_at"]:
                    if elastic.rank() == 1 and not os.path.exists(config["marker"]):
                        Path(config["marker"]).write_text(json.dumps({"time": time.time()}))
                        os.kill(os.getpid(), signal.SIGKILL)
                if "kill_at" in config and os.path.exists(config["marker"]) and "after_kill" not in marks:
                    if elastic.size() == 2 and state.batches > config["kill_at"] - 5:
                        marks["after_kill"] = time.time()
                if state.batches % 5 == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            marks[state.epoch] = time.perf_counter() - began
            state.epoch += 1
            state.commit()
        world_rows = sum(elastic.allgather_object(rows))
        return {"epoch_s": marks.get(1), "rows": world_rows, "after_kill": marks.get("after_kill")}

    return train(state)


def run_elastic(ds, batch: int, workers: int = 2, **extra) -> dict:
    config = {"batch": batch, **extra}
    result = elastic.ElasticTrainer(
        elastic_train_fn,
        2,
        workers,
        config=config,
        datasets={"train": ds},
        resources_per_worker={"CPU": 0.5},
        cooldown_range=(600, 600),
        verbose=0,
    ).fit()
    return {**result.return_value, "events": [e.kind for e in result.events], "metrics": result.metrics_history}


def raytrain_train_fn(config: dict) -> None:
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    for epoch in range(2):
        began = time.perf_counter()
        rows = 0
        for b in shard.iter_batches(batch_size=config["batch"]):
            rows += len(b["id"])
        if epoch == 1 and ray.train.get_context().get_world_rank() == 0:
            Path(config["out"]).write_text(json.dumps({"epoch_s": time.perf_counter() - began}))
    ray.train.report({"rows": rows})


def run_raytrain(ds, batch: int, workdir: Path) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out = workdir / f"rt-{time.monotonic_ns()}.json"
    TorchTrainer(
        raytrain_train_fn,
        train_loop_config={"batch": batch, "out": str(out)},
        datasets={"train": ds},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(workdir / "rt-storage")),
    ).fit()
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--files", type=int, default=20)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    rows_out, resume = [], {}
    with local_cluster():
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            n = write_dataset(workdir / "data", args.files, args.rows)
            ds = ray.data.read_parquet(str(workdir / "data"))
            for rnd in range(args.rounds):
                ours = run_elastic(ds, args.batch)
                theirs = run_raytrain(ds, args.batch, workdir)
                row = {
                    "round": rnd,
                    "elastic_rows_per_s": n / ours["epoch_s"],
                    "raytrain_rows_per_s": n / theirs["epoch_s"],
                    "elastic_rows": ours["rows"],
                }
                row["ratio"] = row["elastic_rows_per_s"] / row["raytrain_rows_per_s"]
                rows_out.append(row)
                print(json.dumps(row), flush=True)
            marker = workdir / "killed"
            per_epoch = n // (3 * args.batch)  # steps of an epoch at 3 workers: the kill comes mid-epoch 1
            killed = run_elastic(ds, args.batch, workers=3, kill_at=per_epoch + per_epoch // 2, marker=str(marker))
            kill_time = json.loads(marker.read_text())["time"]
            resume = {
                "kill_to_next_batch_s": (killed["after_kill"] - kill_time) if killed["after_kill"] else None,
                "events": killed["events"],
                "rows_in_epoch_after": killed["rows"],
            }
            print(json.dumps(resume), flush=True)
    ratios = [r["ratio"] for r in rows_out]
    print(
        f"\nrows/s, {args.files} x {args.rows} rows, batch {args.batch}, 2 workers: "
        f"elastic {statistics.median(r['elastic_rows_per_s'] for r in rows_out):,.0f}, "
        f"Ray Train {statistics.median(r['raytrain_rows_per_s'] for r in rows_out):,.0f}, "
        f"ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
    )
    print(f"resume after a SIGKILL: {resume}")
    write_results("data", rows_out, resume=resume, args=vars(args))


if __name__ == "__main__":
    main()
