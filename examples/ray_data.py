"""Training from a Ray Dataset, elastic: `ElasticTrainer(datasets=...)` and `get_dataset_shard`.

The dataset is streamed to the workers by the run's feed actor, never
materialized; each rank reads its share of every step from its shard, and
every row of an epoch is trained exactly once through failures, joins and
leaves. Here the dataset is built in memory (`ray.data.range`, a linear
target); a real one would be `ray.data.read_parquet("s3://...")`.

    python examples/ray_data.py                 # 2 to 4 workers
    python examples/ray_data.py --smoke         # a few seconds

It prints the rows each epoch trained over all ranks (the dataset's rows,
plus the padding that evens out the last step) and the loss before and after.
Needs the `data` extra (`pip install -e '.[torch,data]'`).
"""

from __future__ import annotations

import argparse

import ray
import torch
from torch import nn

import ray_elastic as elastic


def make_dataset(rows: int) -> ray.data.Dataset:
    """Rows {"id", "x", "y"} with y = 3x - 1: a linear model fits it exactly."""
    return ray.data.range(rows).map_batches(
        lambda b: {"id": b["id"], "x": b["id"] / rows, "y": 3.0 * b["id"] / rows - 1.0}, batch_format="numpy"
    )


def train_fn(config: dict) -> dict:
    shard = elastic.get_dataset_shard("train", shuffle=True, seed=0)  # this rank's share, exact per epoch
    model = elastic.torch.prepare_model(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    # epoch_rows: the rows this epoch trained over all ranks, committed and rolled back with the shard's position
    state = elastic.torch.TorchState(
        model=model, optimizer=opt, data=shard, epoch=0, step=0, epoch_rows=0, rows=[], padding=[]
    )

    @elastic.run
    def train(state: elastic.torch.TorchState) -> dict:
        while state.epoch < config["epochs"]:
            shard.set_epoch(state.epoch)
            for batch in shard.iter_torch_batches(batch_size=config["batch_size"]):  # a dict of tensors
                x, y = batch["x"].float().unsqueeze(1), batch["y"].float().unsqueeze(1)
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                state.epoch_rows += len(x) * elastic.size()  # every rank takes as many rows per step
                state.step += 1
                if state.step % 10 == 0:
                    state.commit()  # the rows handed out so far count as consumed
                else:
                    state.check_host_updates()
                elastic.report({"epoch": state.epoch, "step": state.step, "loss": loss.item()})
            state.rows, state.padding = [*state.rows, state.epoch_rows], [*state.padding, shard.padding_rows]
            state.epoch_rows = 0
            state.epoch += 1
            state.commit()
        return {"rows_per_epoch": state.rows, "padding_per_epoch": state.padding}

    return train(state)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="a short run: 2 epochs of 2,000 rows")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, epochs = (2_000, 2) if args.smoke else (args.rows, args.epochs)
    config = {"epochs": epochs, "batch_size": 64, "lr": 0.5}
    result = elastic.ElasticTrainer(
        train_fn, min_workers=1, max_workers=args.max_workers, config=config, datasets={"train": make_dataset(rows)}
    ).fit()
    value = result.return_value
    first, last = result.metrics_history[0]["loss"], result.metrics["loss"]
    trained, padding = value["rows_per_epoch"], value["padding_per_epoch"]
    print(f"rows trained per epoch {trained} of {rows} (padding {padding}); loss {first:.3f} -> {last:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
