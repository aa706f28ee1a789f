"""PyTorch Lightning: ray-elastic's `ElasticDDPStrategy` beside Ray Train's `RayDDPStrategy`.

One LightningModule (a small convolutional classifier, 0.15M parameters, on
synthetic MNIST-shaped images: 28x28, 10 classes, batch 64 per rank), one
local cluster (a head without CPUs and 2 nodes of 4 CPUs), one thread per
rank. Two measurements:

- **Recovery** from a SIGKILL of one of 4 workers (random rank after a
  random step, seeded; the same kills for both systems). ray-elastic:
  `ElasticDDPStrategy` + `ElasticEnvironment` + `prepare_trainer` in an
  `ElasticTrainer` (min 2, max 4 workers, 2 slots per node), a commit every
  10 optimizer steps; the survivors keep their processes and their Trainer
  and go on at 3. Ray Train v2: `RayDDPStrategy` + `RayLightningEnvironment`
  + `prepare_trainer` in a `TorchTrainer` (4 workers) with
  `FailureConfig(max_failures=3)`, its `RayTrainReportCallback` called every
  `--rt-every` steps (10 by default, as often as ray-elastic commits, so the
  steps redone differ by mechanism, not by setting), and `trainer.fit(...,
  ckpt_path=...)` from `ray.train.get_checkpoint()`: it restarts all 4
  workers from the last reported checkpoint. Recovery = from the kill to
  rank 0's next completed step (`bench/step_log.py`).
- **Throughput** at world 2 and 4: the same module and loader, no faults.
  ray-elastic (commit every 10 steps, host check on the others) against
  plain Lightning DDP on Ray: `RayDDPStrategy` under `TorchTrainer`, which
  is Lightning's `DDPStrategy` (torch DDP over Gloo) with Ray's placement,
  and no checkpoints. Both start side by side and take turns
  (`bench/turns.py`): one window (warm-up, then `--steps` timed optimizer
  steps) each per round, in a rotating order. The ratio is taken per round,
  then the median over rounds.

The dataset has 200,000 samples (2,048 stored images indexed modulo), so
no epoch ends inside a run and every window is steady-state steps.
Prints tables and writes bench/results/lightning.json. Reports, never asserts.

    .venv/bin/python bench/lightning.py [--reps 3] [--rt-reps 2] [--rounds 5] [--steps 40] [--worlds 2,4]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# This file has the name of the package it measures: with its folder first on sys.path, `import lightning`
# would import this file. The folder goes last while the helpers beside it import, then leaves (below).
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _HERE] + [_HERE]

import contextlib  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import ray.cloudpickle  # noqa: E402
import step_log  # noqa: E402
import torch  # noqa: E402
import turns  # noqa: E402
from framework_compare import COMMIT_EVERY_ENV, compare, throughput_row  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import ray_elastic as elastic  # noqa: E402

# Ray hands the script's folder to its workers when it is on sys.path, where it would shadow `lightning`: it
# leaves, and the helpers the workers run travel with the training function instead of being imported there.
sys.path.remove(_HERE)
for _module in (turns, step_log):
    ray.cloudpickle.register_pickle_by_value(_module)

BATCH = 64
COMMIT_EVERY = 10
WARMUP = 5
SAMPLES = 200_000
STORED = 2048


class Digits(Dataset):
    """`SAMPLES` MNIST-shaped images of 10 classes (a class's fixed pattern plus noise), `STORED` kept in memory."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        patterns = torch.randn(10, 1, 28, 28, generator=g)
        self.labels = torch.randint(0, 10, (STORED,), generator=g)
        self.images = patterns[self.labels] + 0.8 * torch.randn(STORED, 1, 28, 28, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i % STORED], self.labels[i % STORED]


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 32, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(32 * 6 * 6, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
        )

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Probe(pl.Callback):
    """After each optimizer step: rank 0's step log, the injected kill, and the throughput windows."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.turns: turns.Turns | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, rank, world = trainer.global_step, trainer.global_rank, trainer.world_size
        if self.config.get("log") and rank == 0:
            step_log.log_step(self.config["log"], step, world)
        kill = self.config.get("kill")
        if kill and step == kill["step"] and rank == kill["rank"]:
            step_log.kill_once(kill["marker"], step)
        if self.config.get("control"):
            if self.turns is None:
                c = self.config
                self.turns = turns.Turns(c["system"], c["control"], rank, world, c["steps"], WARMUP, BATCH * world)
            if self.turns.step_ended():
                trainer.should_stop = True


def trainer_kwargs(config: dict) -> dict:
    return {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": -1,
        "max_steps": config.get("max_steps", -1),
        "enable_checkpointing": False,
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }


def elastic_train_fn(config: dict) -> int:
    from ray_elastic.lightning import ElasticDDPStrategy, ElasticEnvironment, prepare_trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = pl.Trainer(
        strategy=ElasticDDPStrategy(commit_every=int(os.environ.get(COMMIT_EVERY_ENV, COMMIT_EVERY))),
        plugins=[ElasticEnvironment()],
        callbacks=[Probe(config)],
        **trainer_kwargs(config),
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(Classifier(), train_dataloaders=DataLoader(Digits(), batch_size=BATCH, shuffle=True))
    return trainer.global_step


def raytrain_train_fn(config: dict) -> None:
    import ray.train
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    class EveryNSteps(RayTrainReportCallback):
        """Ray Train's own report callback (save, report, barrier), called every `every` optimizer steps."""

        def __init__(self, every: int) -> None:
            super().__init__()
            self.every = every

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step % self.every == 0:
                self.on_train_epoch_end(trainer, pl_module)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    callbacks = [Probe(config)]
    if config.get("every"):
        callbacks.append(EveryNSteps(config["every"]))
    trainer = pl.Trainer(
        strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()], callbacks=callbacks, **trainer_kwargs(config)
    )
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else contextlib.nullcontext() as d:
        ckpt_path = os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME) if d else None
        loader = DataLoader(Digits(), batch_size=BATCH, shuffle=True)
        trainer.fit(Classifier(), train_dataloaders=loader, ckpt_path=ckpt_path)


def run_raytrain(config: dict, workers: int, storage: str, name: str, max_failures: int = 0) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        raytrain_train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=max_failures)),
    ).fit()


# ---- recovery --------------------------------------------------------------------------------------------


def elastic_rep(kill: dict, slots: dict[str, int], workdir: str, rep: int) -> dict:
    log, marker = os.path.join(workdir, f"el-log-{rep}"), os.path.join(workdir, f"el-killed-{rep}")
    config = {"log": log, "kill": {**kill, "marker": marker}, "max_steps": kill["step"] + 15}
    result = elastic.ElasticTrainer(
        elastic_train_fn,
        min_workers=2,
        max_workers=4,
        config=config,
        discovery=functools.partial(dict, slots),  # 2 slots per node: after the kill no free slot, so 4 -> 3
        cooldown_range=(120, 120),
        verbose=0,
    ).fit()
    row = {"kill_rank": kill["rank"], **step_log.read_recovery(log, marker), "final_step": result.return_value}
    row["reset_s"] = next((e.reset_duration for e in result.events if e.kind == "worker_failed"), None)
    return row


def raytrain_rep(kill: dict, every: int, workdir: str, rep: int) -> dict:
    log, marker = os.path.join(workdir, f"rt-log-{rep}"), os.path.join(workdir, f"rt-killed-{rep}")
    config = {"log": log, "kill": {**kill, "marker": marker}, "max_steps": kill["step"] + 15, "every": every}
    run_raytrain(config, 4, os.path.join(workdir, "rt-storage"), f"rt-lightning-{rep}", max_failures=3)
    return {"kill_rank": kill["rank"], **step_log.read_recovery(log, marker)}


# ---- throughput ------------------------------------------------------------------------------------------


def throughput(world: int, rounds: int, steps: int, workdir: str) -> dict:
    def run_elastic(control: str) -> None:
        config = {"system": "elastic", "control": control, "steps": steps}
        elastic.ElasticTrainer(elastic_train_fn, world, world, config=config, verbose=0).fit()

    def run_plain(control: str) -> None:
        config = {"system": "ddp", "control": control, "steps": steps}
        run_raytrain(config, world, os.path.join(workdir, "rt-storage"), f"rt-lightning-tput-{world}")

    rates = turns.measure({"elastic": run_elastic, "ddp": run_plain}, rounds, f"world {world}")
    return throughput_row(world, steps, BATCH, rates)


def main() -> None:
    compare(
        "lightning",
        ("ray-elastic (ElasticDDPStrategy), 4 -> 3", "Ray Train (RayDDPStrategy)"),
        elastic_rep,
        raytrain_rep,
        throughput,
        commit_every=COMMIT_EVERY,
        default_steps=40,
        lightning=pl.__version__,
        batch_per_rank=BATCH,
        warmup=WARMUP,
    )


if __name__ == "__main__":
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    main()
