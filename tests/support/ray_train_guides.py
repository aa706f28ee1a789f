"""Ray Train v2 scripts in the shape of Ray's own guides, on synthetic data; only the imports are ray_elastic's.

`checkpoint_guide_loop` is the checkpoint guide's loop ("Saving and Loading
Checkpoints"): the model and optimizer restored from `get_checkpoint()` at
the top, a checkpoint saved into a temporary directory and passed to
`ray.train.report` every epoch, and an intentional error after an epoch on
every rank, once, to show restoration under `FailureConfig(max_failures=1)`.
Its batches come from a Ray Dataset as the regression example builds one: a
pandas frame with a list-valued feature column and a tensor column, read
with `get_dataset_shard("train").iter_torch_batches(dtypes=...)`. It also logs
`get_context()`'s fields, and can SIGKILL itself once (`kill`).

The log (JSON lines, one file for every worker) holds each entry into the
loop (pid, rank, world, the epoch it starts at, the context's fields) and
each batch's shapes and dtypes.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time

import numpy as np
import pandas as pd
import ray.train
import torch
from torch import nn

from ray_elastic.train import FailureConfig, RunConfig, ScalingConfig
from ray_elastic.train.torch import TorchTrainer, prepare_model

ROWS, FEATURES = 64, 8
# Ray's iter_torch_batches takes a dtype for every column when given a dict (a column left out is its KeyError)
DTYPES = {"features": torch.float32, "grid": torch.float32, "label": torch.float64, "id": torch.int64}


def regression_frame() -> pd.DataFrame:
    """The regression example's frame: a list-valued feature column, a (2, 2) tensor per row, a float label."""
    rng = np.random.default_rng(0)
    features = rng.normal(size=(ROWS, FEATURES))
    grid = rng.normal(size=(ROWS, 2, 2))
    label = features @ np.linspace(-1, 1, FEATURES) + grid.sum(axis=(1, 2))
    return pd.DataFrame(
        {"features": [list(f) for f in features], "grid": list(grid), "label": label, "id": np.arange(ROWS)}
    )


def _log(config: dict, **record) -> None:
    with open(config["log"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "time": time.time(), **record}) + "\n")


def checkpoint_guide_loop(config: dict) -> None:
    model = prepare_model(nn.Linear(FEATURES + 4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            saved = torch.load(os.path.join(d, "model.pt"))
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch = saved["epoch"] + 1
    ctx = ray.train.get_context()
    fields = {
        "world_rank": ctx.get_world_rank(),
        "world_size": ctx.get_world_size(),
        "local_rank": ctx.get_local_rank(),
        "local_world_size": ctx.get_local_world_size(),
        "node_rank": ctx.get_node_rank(),
        "experiment": ctx.get_experiment_name(),
    }
    _log(config, entry=True, start_epoch=start_epoch, **fields)
    shard = ray.train.get_dataset_shard("train")
    for epoch in range(start_epoch, config["epochs"]):
        total, batches = 0.0, 0
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"], dtypes=DTYPES):
            described = {k: [str(v.dtype), list(v.shape)] for k, v in batch.items()}
            _log(config, epoch=epoch, batch=described, ids=batch["id"].tolist(), rank=ctx.get_world_rank())
            x = torch.cat([batch["features"], batch["grid"].flatten(1)], dim=1)
            loss = nn.functional.mse_loss(model(x).squeeze(1), batch["label"].float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
            time.sleep(config.get("step_sleep", 0.0))  # stands for a real step's compute
            kill = config.get("kill")
            if kill and [epoch, batches] == kill["at"] and ctx.get_world_rank() == kill["rank"]:
                if not os.path.exists(kill["marker"]):
                    with open(kill["marker"], "w") as f:
                        f.write(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
        with tempfile.TemporaryDirectory() as tmp:
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            torch.save(state, os.path.join(tmp, "model.pt"))
            metrics = {"loss": total / max(batches, 1), "epoch": epoch}
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        if epoch == config.get("raise_after_epoch") and not checkpoint:
            # the guide's intentional error, on every rank: the attempt restored from a checkpoint does not raise
            raise RuntimeError(f"Intentional error to showcase restoration (rank {ctx.get_world_rank()})")


def checkpoint_guide_trainer(config: dict, num_workers, storage_path: str, name: str = "guide", max_failures: int = 1):
    """The guide's `TorchTrainer` over the regression frame, not yet fitted."""
    import ray.data

    return TorchTrainer(
        checkpoint_guide_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(name=name, storage_path=storage_path, failure_config=FailureConfig(max_failures)),
        datasets={"train": ray.data.from_pandas(regression_frame())},
    )


def key_concepts_loop(config: dict) -> None:
    """The key-concepts page's plain loop under `DataParallelTrainer`: no framework, a JSON checkpoint.

    It trains a running sum over the split dataset "train", reads the whole
    dataset "valid" (left unsplit by `DataConfig(datasets_to_split=["train"])`)
    on every rank, and reports `get_all_reported_checkpoints()` after a
    re-entry.
    """
    ctx = ray.train.get_context()
    start, total = 0, 0.0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d, open(os.path.join(d, "state.json")) as f:
            saved = json.load(f)
        start, total = saved["epoch"] + 1, saved["total"]
    kept = [c.checkpoint.path for c in ray.train.get_all_reported_checkpoints()] if checkpoint else []
    _log(config, entry=True, start_epoch=start, rank=ctx.get_world_rank(), kept=kept)
    for epoch in range(start, config["epochs"]):
        for batch in ray.train.get_dataset_shard("train").iter_batches(batch_size=4):
            total += float(batch["id"].sum())
            _log(config, epoch=epoch, ids=batch["id"].tolist(), rank=ctx.get_world_rank())
            kill = config.get("kill")
            if kill and epoch == kill["epoch"] and ctx.get_world_rank() == kill["rank"]:
                if not os.path.exists(kill["marker"]):
                    with open(kill["marker"], "w") as f:
                        f.write(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(config.get("step_sleep", 0.0))
        valid = sorted(int(i) for b in ray.train.get_dataset_shard("valid").iter_batches(batch_size=8) for i in b["id"])
        _log(config, epoch=epoch, valid=valid, rank=ctx.get_world_rank())
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "state.json"), "w") as f:
                json.dump({"epoch": epoch, "total": total}, f)
            ray.train.report({"epoch": epoch, "total": total}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def fit_key_concepts(config: dict, num_workers, storage_path: str, name: str = "concepts"):
    import ray.data

    from ray_elastic.train import DataConfig, DataParallelTrainer

    return DataParallelTrainer(
        key_concepts_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(name=name, storage_path=storage_path),
        datasets={"train": ray.data.range(ROWS), "valid": ray.data.range(16)},
        dataset_config=DataConfig(datasets_to_split=["train"]),
    ).fit()
