"""Fine-tuning with Hugging Face's `transformers.Trainer`, elastic: `prepare_trainer`.

A small GPT-2 built from a config (nothing downloaded) learns synthetic token
sequences, each counting up from a random start by a step of 1 to 3. The
training function is the Trainer script a user already has, plus one line:
`prepare_trainer(trainer)`. Under `ElasticTrainer.fit()` the Trainer then
keeps training through lost and added workers, in the same processes.

    python examples/hf_finetune.py                 # on a local Ray it starts
    python examples/hf_finetune.py --max-steps 300 --workers 4
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import ray_elastic as elastic
from ray_elastic.transformers import prepare_trainer

VOCAB, SEQ = 256, 32


class CountingTokens(torch.utils.data.Dataset):
    """`n` sequences `(start + step*t) % VOCAB`, drawn once from a fixed seed."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (n, 1), generator=g)
        steps = torch.randint(1, 4, (n, 1), generator=g)
        self.tokens = (starts + steps * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def train_fn(config: dict) -> dict:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, n_positions=SEQ, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0
        )
    )
    args = transformers.TrainingArguments(
        output_dir=config["out"],
        max_steps=config["max_steps"],
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=20,
        disable_tqdm=True,
    )
    dataset = CountingTokens(config["samples"])
    trainer = prepare_trainer(transformers.Trainer(model=model, args=args, train_dataset=dataset))
    output = trainer.train()
    trainer.save_model(config["out"])  # written by the current rank 0 only
    elastic.report({"global_step": trainer.state.global_step, "train_loss": output.training_loss})
    return {"global_step": trainer.state.global_step, "log_history": trainer.state.log_history[-3:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=2, help="max_workers (min_workers is 1)")
    opts = parser.parse_args()
    out = tempfile.mkdtemp(prefix="hf_finetune_")
    result = elastic.ElasticTrainer(
        train_fn,
        min_workers=1,
        max_workers=opts.workers,
        config={"out": out, "max_steps": opts.max_steps, "samples": opts.samples},
    ).fit()
    print(f"trained {result.return_value['global_step']} steps; last logs: {result.return_value['log_history']}")
    print(f"model saved in {out}; membership events: {[e.kind for e in result.events]}")


if __name__ == "__main__":
    main()
