"""Hugging Face transformers.Trainer: ray-elastic's `prepare_trainer` beside Ray Train's `prepare_trainer`.

One model (a GPT-2 built from a config, nothing downloaded: 2 layers,
n_embd 64, vocabulary 256, 0.12M parameters), one dataset (synthetic token
sequences of 32 counting up from a random start, as in
examples/hf_finetune.py), batch 8 per rank, AdamW, one local cluster (a
head without CPUs and 2 nodes of 4 CPUs), one thread per rank. Two
measurements:

- **Recovery** from a SIGKILL of one of 4 workers (random rank after a
  random step, seeded; the same kills for both systems). ray-elastic:
  `ray_elastic.transformers.prepare_trainer` (a commit every 10 optimizer
  steps) in an `ElasticTrainer` (min 2, max 4 workers, 2 slots per node);
  the survivors keep their processes and their Trainer and go on at 3.
  Ray Train v2: `ray.train.huggingface.transformers.prepare_trainer` and
  its `RayTrainReportCallback` in a `TorchTrainer` (4 workers) with
  `FailureConfig(max_failures=3)`, the Trainer saving every `--rt-every`
  steps (10 by default, as often as ray-elastic commits) into a folder per
  rank (rank 0 writes the model and optimizer, every rank its RNG state;
  Ray Train gathers them into one checkpoint), and
  `trainer.train(resume_from_checkpoint=...)` from
  `ray.train.get_checkpoint()`: it restarts all 4 workers from the last
  reported checkpoint. Recovery = from the kill to rank 0's next completed
  step (`bench/step_log.py`).
- **Throughput** at world 2 and 4, no faults: ray-elastic against plain
  `Trainer` DDP on Ray: Ray Train's `prepare_trainer` under `TorchTrainer`,
  where Accelerate wraps the model in torch DDP over the Gloo group Ray
  Train set up, and nothing is saved. Both start side by side and take
  turns (`bench/turns.py`): one window (warm-up, then `--steps` timed
  optimizer steps) each per round, in a rotating order; the ratio is taken
  per round, then the median over rounds.

The dataset has 200,000 sequences (computed from the index), so no epoch
ends inside a run and every window is steady-state steps.
Prints tables and writes bench/results/transformers.json. Reports, never asserts.

    .venv/bin/python bench/transformers.py [--reps 3] [--rt-reps 2] [--rounds 5] [--steps 30] [--worlds 2,4]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# This file has the name of the package it measures: with its folder first on sys.path, `import transformers`
# would import this file. The folder goes last while the helpers beside it import, then leaves (below).
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != _HERE] + [_HERE]

import contextlib  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402

import ray.cloudpickle  # noqa: E402
import step_log  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import turns  # noqa: E402
from framework_compare import COMMIT_EVERY_ENV, compare, throughput_row  # noqa: E402

import ray_elastic as elastic  # noqa: E402

# Ray hands the script's folder to its workers when it is on sys.path, where it would shadow `transformers`:
# it leaves, and the helpers the workers run travel with the training function instead of being imported there.
sys.path.remove(_HERE)
for _module in (turns, step_log):
    ray.cloudpickle.register_pickle_by_value(_module)

BATCH = 8
COMMIT_EVERY = 10
WARMUP = 5
VOCAB, SEQ = 256, 32
SAMPLES = 200_000
STORED = 4096


class CountingTokens(torch.utils.data.Dataset):
    """`SAMPLES` sequences `(start + step*t) % VOCAB`; `STORED` (start, step) pairs drawn once, indexed modulo."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.starts = torch.randint(0, VOCAB, (STORED, 1), generator=g)
        self.steps = torch.randint(1, 4, (STORED, 1), generator=g)
        self.t = torch.arange(SEQ)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict:
        j = i % STORED
        tokens = (self.starts[j] + self.steps[j] * self.t) % VOCAB
        return {"input_ids": tokens, "labels": tokens}


def make_model() -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


class Probe(transformers.TrainerCallback):
    """After each optimizer step: rank 0's step log, the injected kill, and the throughput windows."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.turns: turns.Turns | None = None

    def on_step_end(self, args, state, control, **kwargs):
        step, rank, world = state.global_step, args.process_index, args.world_size
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
                control.should_training_stop = True
        return control


def training_args(config: dict, output_dir: str, **overrides) -> transformers.TrainingArguments:
    kwargs = {
        "output_dir": output_dir,
        "max_steps": config.get("max_steps", 1_000_000),
        "per_device_train_batch_size": BATCH,
        "learning_rate": 1e-3,
        "use_cpu": True,
        "report_to": [],
        "save_strategy": "no",
        "logging_steps": 50,
        "disable_tqdm": True,
        "seed": 0,
        **overrides,
    }
    return transformers.TrainingArguments(**kwargs)


def elastic_train_fn(config: dict) -> int:
    from ray_elastic.transformers import prepare_trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = transformers.Trainer(
        model=make_model(),
        args=training_args(config, os.path.join(config["out"], "elastic")),
        train_dataset=CountingTokens(),
        callbacks=[Probe(config)],
    )
    trainer = prepare_trainer(trainer, commit_every=int(os.environ.get(COMMIT_EVERY_ENV, COMMIT_EVERY)))
    trainer.train()
    return trainer.state.global_step


def raytrain_train_fn(config: dict) -> None:
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = ray.train.get_context().get_world_rank()
    callbacks = [Probe(config)]
    save = {}
    if config.get("every"):
        callbacks.append(RayTrainReportCallback())
        save = {"save_strategy": "steps", "save_steps": config["every"]}
    # a folder per rank: rank 0 saves the model and optimizer, every rank its RNG state, Ray Train gathers them
    output_dir = os.path.join(config["out"], f"rank-{rank}")
    trainer = transformers.Trainer(
        model=make_model(),
        args=training_args(config, output_dir, **save),
        train_dataset=CountingTokens(),
        callbacks=callbacks,
    )
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()
    with checkpoint.as_directory() if checkpoint else contextlib.nullcontext() as d:
        trainer.train(resume_from_checkpoint=os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME) if d else None)


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
    config = {
        "log": log,
        "kill": {**kill, "marker": marker},
        "max_steps": kill["step"] + 15,
        "out": os.path.join(workdir, f"el-out-{rep}"),
    }
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
    config = {
        "log": log,
        "kill": {**kill, "marker": marker},
        "max_steps": kill["step"] + 15,
        "every": every,
        "out": os.path.join(workdir, f"rt-out-{rep}"),
    }
    run_raytrain(config, 4, os.path.join(workdir, "rt-storage"), f"rt-transformers-{rep}", max_failures=3)
    return {"kill_rank": kill["rank"], **step_log.read_recovery(log, marker)}


# ---- throughput ------------------------------------------------------------------------------------------


def throughput(world: int, rounds: int, steps: int, workdir: str) -> dict:
    def run_elastic(control: str) -> None:
        config = {"system": "elastic", "control": control, "steps": steps, "out": os.path.join(workdir, "el-tput")}
        elastic.ElasticTrainer(elastic_train_fn, world, world, config=config, verbose=0).fit()

    def run_plain(control: str) -> None:
        config = {"system": "ddp", "control": control, "steps": steps, "out": os.path.join(workdir, f"tput-{world}")}
        run_raytrain(config, world, os.path.join(workdir, "rt-storage"), f"rt-transformers-tput-{world}")

    rates = turns.measure({"elastic": run_elastic, "ddp": run_plain}, rounds, f"world {world}")
    return throughput_row(world, steps, BATCH, rates)


def main() -> None:
    compare(
        "transformers",
        ("ray-elastic prepare_trainer, 4 -> 3", "Ray Train prepare_trainer"),
        elastic_rep,
        raytrain_rep,
        throughput,
        commit_every=COMMIT_EVERY,
        default_steps=30,
        transformers=transformers.__version__,
        batch_per_rank=BATCH,
        warmup=WARMUP,
    )


if __name__ == "__main__":
    logging.getLogger("transformers").setLevel(logging.ERROR)
    main()
