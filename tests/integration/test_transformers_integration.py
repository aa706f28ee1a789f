"""End to end on the local Ray cluster: a `transformers.Trainer` prepared by `prepare_trainer`.

A tiny GPT-2 built from a config (no download) fine-tunes on synthetic
token sequences on 4 workers. One worker is SIGKILLed mid-run and, once the
survivors train on 3, a node is added: the newcomer receives the commit. The
test reads from the run what a user would see: the final `global_step`, the
ranks' parameters, which samples each epoch trained (a ledger kept in the
`TrainerState`, so it rolls back with it), the survivors' process ids, and
the final loss against a fault-free run's (one process, the same global batch).
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import wait_until
from runs import fit_in_thread

from ray_elastic import ElasticTrainer

pytestmark = pytest.mark.integration
pytest.importorskip("transformers")  # the `transformers` extra

N_SAMPLES = 96
SEQ = 16
VOCAB = 64


class PatternDataset:
    """Sequences `(start + k*t) % VOCAB`, from a fixed generator; `collate` logs each batch's indices."""

    def __init__(self) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        starts = torch.randint(0, VOCAB, (N_SAMPLES,), generator=g)
        steps = torch.randint(1, 4, (N_SAMPLES,), generator=g)
        t = torch.arange(SEQ)
        self.tokens = (starts[:, None] + steps[:, None] * t[None, :]) % VOCAB
        self.batches: list[list[int]] = []

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i], "idx": int(i)}

    def collate(self, features: list[dict]) -> dict:
        import torch

        self.batches.append([f["idx"] for f in features])
        return {k: torch.stack([f[k] for f in features]) for k in ("input_ids", "labels")}


def tiny_gpt2():
    """One layer of GPT-2 built from a config (nothing downloaded), its initial weights from seed 0."""
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
        )
    )


def training_args(output_dir: str, max_steps: int, per_rank_batch: int):
    """The run's and the reference's `TrainingArguments`: the same LR, seed and steps; only the batch differs."""
    import transformers

    return transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=per_rank_batch,
        learning_rate=1e-2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
    )


def final_loss(model, dataset: PatternDataset) -> float:
    """The model's loss over every sequence of the dataset."""
    import torch

    with torch.no_grad():
        return model(input_ids=dataset.tokens, labels=dataset.tokens).loss.item()


def hf_train_fn(config: dict) -> dict:
    import torch
    import transformers

    import ray_elastic as elastic
    from ray_elastic.transformers import prepare_trainer

    Path(config["starts"], f"{os.getpid()}").touch()  # one file per train_fn start: restarts would show
    model = tiny_gpt2()
    dataset = PatternDataset()

    class Story(transformers.TrainerCallback):
        """The ledger of trained samples, the injected SIGKILL, and the pace while the test adds a node."""

        def on_step_end(self, args, state, control, **kwargs):
            # the step trained the last batch fetched (one per step); earlier ones belong to a rolled-back step
            trained = elastic.allgather_object(dataset.batches[-1])
            dataset.batches = []
            ledger = getattr(state, "ledger", [])
            ledger.append([math.ceil(state.epoch) - 1, [i for part in trained for i in part], elastic.size()])
            state.ledger = ledger
            kill = config.get("kill")
            if kill and state.global_step == kill["step"] and elastic.rank() == kill["rank"]:
                try:
                    os.close(os.open(kill["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
            if config.get("signal") and elastic.size() < 4 and elastic.rank() == 0:
                Path(config["signal"]).touch()
            if config.get("signal") and elastic.size() < 4:
                time.sleep(0.4)  # keeps the run going while the newcomer boots; all ranks alike

    args = training_args(config["out"], config["max_steps"], per_rank_batch=4)
    trainer = prepare_trainer(
        transformers.Trainer(
            model=model, args=args, train_dataset=dataset, data_collator=dataset.collate, callbacks=[Story()]
        ),
        commit_every=5,
    )
    trainer.train()

    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    digests = elastic.allgather_object(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    pids = elastic.allgather_object(os.getpid())
    loss = final_loss(trainer.model, dataset)
    return {
        "global_step": trainer.state.global_step,
        "digests": digests,
        "pids": pids,
        "ledger": trainer.state.ledger,
        "loss": loss,
    }


def _config(tmp_path: Path, name: str, max_steps: int) -> dict:
    starts = tmp_path / f"{name}-starts"
    starts.mkdir()
    return {"out": str(tmp_path / f"{name}-out"), "starts": str(starts), "max_steps": max_steps}


def test_trainer_goes_on_through_a_sigkill_and_a_node_added(cluster, no_leaks, tmp_path):
    max_steps = 60
    config = _config(tmp_path, "faulty", max_steps)
    config["kill"] = {"rank": 2, "step": 12, "marker": str(tmp_path / "killed")}
    config["signal"] = str(tmp_path / "shrunk")
    fut = fit_in_thread(
        ElasticTrainer(hf_train_fn, min_workers=2, max_workers=4, config=config, cooldown_range=(60, 120), verbose=0)
    )
    wait_until(Path(config["signal"]).exists, 180, "the survivors to train on 3 workers after the SIGKILL")
    node = cluster.add_node(num_cpus=2)
    try:
        result = fut.result(timeout=240)
    finally:
        cluster.remove_node(node)
    out = result.return_value

    kinds = [e.kind for e in result.events]
    assert kinds[:2] == ["start", "worker_failed"] and "hosts_added" in kinds, kinds
    assert out["global_step"] == max_steps
    assert len(out["digests"]) == 4 and len(set(out["digests"])) == 1, f"ranks diverged: {out['digests']}"

    # the 3 survivors kept their processes: train_fn started 5 times (4, then the newcomer), never again
    starts = {int(p.name) for p in Path(config["starts"]).iterdir()}
    assert len(starts) == 5, starts
    assert set(out["pids"]) <= starts and len(set(out["pids"])) == 4

    # the ledger rolled back with the state: one entry per optimizer step, and each epoch trained every
    # sample once; the only repeats are the padding of an uneven split (fewer than the world size each)
    ledger = out["ledger"]
    assert len(ledger) == max_steps
    assert {size for _, _, size in ledger} == {3, 4}
    by_epoch: dict[int, list[int]] = collections.defaultdict(list)
    for epoch, indices, _ in ledger:
        by_epoch[epoch].extend(indices)
    last = max(by_epoch)
    for epoch, indices in by_epoch.items():
        counts = collections.Counter(indices)
        repeats = sum(c - 1 for c in counts.values())
        assert repeats <= 3 * 2, f"epoch {epoch}: {repeats} samples trained twice"
        if epoch != last:
            assert set(counts) == set(range(N_SAMPLES)), f"epoch {epoch} missed {set(range(N_SAMPLES)) - set(counts)}"

    clean = reference_loss(tmp_path, max_steps)
    print(json.dumps({"loss_faulty": out["loss"], "loss_clean": clean, "events": kinds}))
    assert abs(out["loss"] - clean) <= 0.05 * clean, (out["loss"], clean)


def reference_loss(tmp_path: Path, max_steps: int) -> float:
    """The fault-free run's final loss, in this process: the same model, data, seed and steps.

    One process taking the 4 workers' batches at once (16 sequences) takes
    the same optimizer steps as 4 DDP ranks of 4 whose gradients are
    averaged; only the sample order differs, as it does between any two
    elastic runs. No Ray: seconds instead of a second cluster run.
    """
    import transformers

    model = tiny_gpt2()
    dataset = PatternDataset()
    args = training_args(str(tmp_path / "reference-out"), max_steps, per_rank_batch=16)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, data_collator=dataset.collate)
    trainer.train()
    return final_loss(trainer.model, dataset)
