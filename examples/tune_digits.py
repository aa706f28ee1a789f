"""A hyperparameter search whose trials are elastic runs: 4 digits trials (lr, batch size) under ASHA.

Each trial trains the digits MLP of `examples/digits.py` on 1-2 workers:
Tune reserves one worker per trial, and a trial grows to two where the
cluster has room beyond the others' reservations (as ASHA stops the weaker
trials, the survivors grow). Rank 0 reports the validation loss once per
epoch; ASHA compares the trials at epochs 2, 4 and 8 and stops the weaker
half each time. Every trial checkpoints into its own directory, handed to
Tune, so the best trial's checkpoint is plain files: `model.pt` loads into
a fresh model with plain `torch.load`.

    pip install -e '.[tune,examples]'   # in a ray-elastic checkout
    python examples/tune_digits.py        # a local cluster: a head and two 2-CPU nodes
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import ray
import torch
import torch.nn.functional as F
from ray import tune
from ray.cluster_utils import Cluster
from ray.tune.schedulers import ASHAScheduler
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import digits  # noqa: E402

import ray_elastic as elastic  # noqa: E402

EPOCHS = 8


def train_fn(config: dict) -> None:
    torch.manual_seed(0)
    x_train, y_train, x_val, y_val = digits.load_data(0)
    dataset = TensorDataset(x_train, y_train)
    model = digits.make_model()
    base = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    optimizer = elastic.torch.DistributedOptimizer(base, named_parameters=model.named_parameters())
    sampler = elastic.torch.ElasticSampler(dataset, shuffle=True, seed=0)
    # the global batch stays config["batch_size"]: each of the N ranks takes 1/N of it
    state = elastic.torch.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    @elastic.run
    def train(state: elastic.torch.TorchState) -> None:
        per_rank = max(1, config["batch_size"] // elastic.size())
        loader = DataLoader(dataset, batch_size=per_rank, sampler=sampler)
        while state.epoch < config["epochs"]:
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                sampler.record_batch(i, per_rank)
                state.check_host_updates()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            with torch.no_grad():
                val_loss = F.cross_entropy(model(x_val), y_val).item()
            elastic.report(
                {
                    "epoch": state.epoch,
                    "val_loss": val_loss,
                    "val_accuracy": digits.accuracy(model, x_val, y_val),
                    "world_size": elastic.size(),
                }
            )

    train(state)


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    out = tempfile.mkdtemp(prefix="tune_digits_")
    try:
        trainer = elastic.ElasticTrainer(
            train_fn,
            min_workers=1,
            max_workers=2,
            config={"epochs": EPOCHS},
            checkpoint_dir=os.path.join(out, "checkpoints"),
            checkpoint_every=1,
            verbose=0,
        )
        grid = tune.Tuner(
            trainer.as_trainable(),
            param_space={
                "lr": tune.grid_search([0.003, 0.03]),
                "batch_size": tune.grid_search([16, 64]),
            },
            tune_config=tune.TuneConfig(
                metric="val_loss",
                mode="min",
                scheduler=ASHAScheduler(time_attr="epoch", max_t=EPOCHS, grace_period=2, reduction_factor=2),
            ),
            run_config=tune.RunConfig(name="tune_digits", storage_path=os.path.join(out, "tune"), verbose=1),
        ).fit()
        for result in grid:
            m = result.metrics
            print(
                f"lr={result.config['lr']:<6} batch={result.config['batch_size']:<3} epochs={m['epoch']} "
                f"val_loss={m['val_loss']:.3f} val_accuracy={m['val_accuracy']:.3f} world_size={m['world_size']}"
            )
        best = grid.get_best_result()
        print(
            f"best trial: lr={best.config['lr']}, batch size {best.config['batch_size']}: "
            f"val_loss {best.metrics['val_loss']:.3f}, val_accuracy {best.metrics['val_accuracy']:.3f}"
        )
        print(f"its checkpoint: {best.checkpoint.path}")
        model = digits.make_model()
        model.load_state_dict(torch.load(os.path.join(best.checkpoint.path, "model.pt")))
        _, _, x_val, y_val = digits.load_data(0)
        print(f"model.pt loaded with plain torch.load: val_accuracy {digits.accuracy(model, x_val, y_val):.3f}")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
