"""Real GPU training loops through a SIGKILL and a newcomer, ending bitwise equal; checkpoints that open on a CPU.

Two workers at `{"GPU": 0.5}` share GPU 0 (the ring is torch Gloo with host
staging): rank 1 is SIGKILLed at step 12, a replacement joins, and every
rank ends with the same bytes. The loops are the ones users write:

- the `prepare_model` (DDP) and the `DistributedOptimizer` path, each with
  AdamW (its `step` stays a CPU tensor beside CUDA moments), StepLR, float16
  autocast with a `GradScaler`, and an `ElasticSampler` (a CPU bitmap);
- Lightning with `accelerator="gpu"`;
- the Hugging Face `Trainer` on the GPU.

Then a run with `checkpoint_dir` is resumed by a second `fit()` on the GPU,
and its checkpoint opened with plain `torch.load(weights_only=True)` in a
process that sees no GPU (`CUDA_VISIBLE_DEVICES=""`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_elastic import ElasticTrainer

N, BATCH = 512, 16


def _kill_once(config: dict, step: int, rank: int) -> None:
    kill = config.get("kill")
    if kill and step == kill["step"] and rank == kill["rank"]:
        try:
            os.close(os.open(kill["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_world(state, size: int) -> None:
    """A replaced worker rejoins before training goes on, so the steps after a kill run on the full world."""
    import ray_elastic as elastic

    deadline = time.monotonic() + 120
    while elastic.size() < size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the world did not grow back to {size} workers within 120 s")
        time.sleep(0.05)
        state.check_host_updates()  # raises HostsUpdatedInterrupt once the newcomer is ready


def _digest(tensors) -> str:
    import torch

    return hashlib.sha256(
        b"".join(t.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors)
    ).hexdigest()


def amp_train_fn(config: dict) -> dict:
    """AdamW + StepLR + float16 AMP + an ElasticSampler, on the DDP or the DistributedOptimizer path."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ray_elastic as elastic
    import ray_elastic.torch as etorch
    from ray_elastic.runtime.ring_ops import group

    g = torch.Generator().manual_seed(0)
    x_all = torch.randn(N, 16, generator=g)
    dataset = TensorDataset(x_all, x_all.sum(dim=1, keepdim=True))
    torch.manual_seed(elastic.rank())  # ranks start different: the first sync must make them equal
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    device = etorch.get_device()
    if config["path"] == "ddp":
        model = etorch.prepare_model(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        model = model.to(device)
        opt = etorch.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3), named_parameters=model.named_parameters()
        )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    scaler = torch.amp.GradScaler("cuda")
    sampler = etorch.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    state = etorch.TorchState(
        model=model, optimizer=opt, scheduler=sched, scaler=scaler, sampler=sampler, epoch=0, step=0
    )

    @elastic.run
    def train(state) -> dict:
        _wait_for_world(state, config["world"])
        while state.epoch < config["epochs"]:
            for i, (x, y) in enumerate(loader):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = (model(x).float() - y).pow(2).mean()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                sampler.record_batch(i, BATCH)
                state.step += 1
                _kill_once(config, state.step, elastic.rank())
                if state.step % 5 == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
        moments = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
        return {
            "backend": group().name,
            "devices": elastic.allgather_object(sorted({str(t.device) for t in moments})),
            "digests": elastic.allgather_object(
                (_digest([*model.parameters(), *moments]), scaler.get_scale(), sched.get_last_lr())
            ),
            "steps": state.step,
        }

    return train(state)


def _through_a_kill(train_fn, tmp_path: Path, config: dict, kill_step: int) -> dict:
    """Two workers sharing GPU 0 (`{"GPU": 0.5}`); rank 1 SIGKILLed once at `kill_step`: rank 0's return value."""
    marker = tmp_path / "killed"
    result = ElasticTrainer(
        train_fn,
        min_workers=1,
        max_workers=2,
        config={**config, "kill": {"step": kill_step, "rank": 1, "marker": str(marker)}},
        resources_per_worker={"CPU": 1, "GPU": 0.5},
        cooldown_range=(0, 1),
        collective_timeout=30,
        verbose=0,
    ).fit()
    assert marker.exists() and "worker_failed" in [e.kind for e in result.events]
    return result.return_value


@pytest.mark.parametrize("path", ["optimizer", "ddp"])
def test_adamw_steplr_amp_and_a_sampler_through_a_sigkill_on_a_shared_gpu_end_bitwise_equal(gpu_ray, tmp_path, path):
    out = _through_a_kill(amp_train_fn, tmp_path, {"path": path, "world": 2, "epochs": 2}, kill_step=12)
    assert out["backend"] == "gloo"
    assert out["steps"] == 2 * N // (2 * BATCH), out["steps"]  # every batch of two epochs once, at world 2
    # AdamW's moments on the GPU, its step on the CPU (torch's rule), on every rank, the newcomer's too
    assert all(d == ["cpu", "cuda:0"] for d in out["devices"]), out["devices"]
    assert len({str(d) for d in out["digests"]}) == 1, f"ranks diverged: {out['digests']}"


def lightning_train_fn(config: dict) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import ray_elastic as elastic
    from ray_elastic.lightning import ElasticDDPStrategy, ElasticEnvironment, prepare_trainer

    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    data = TensorDataset(x, x @ torch.arange(1.0, 9.0).unsqueeze(1))

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.trained_on = ""  # the device of the last step (Lightning's teardown moves the model to the CPU)

        def training_step(self, batch, batch_idx):
            _kill_once(config, self.global_step, self.global_rank)
            if self.trainer.world_size < 2:
                time.sleep(0.1)  # alone after the kill: paced, so that the replacement joins mid-run
            self.trained_on = str(self.device)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_epoch_end(self) -> None:
            # every rank stops at the end of the first epoch after the second one that ran at world 2
            rejoined = self.current_epoch >= 1 and self.trainer.world_size == 2
            if self.trainer.strategy.reduce_boolean_decision(rejoined, all=False):
                self.trainer.should_stop = True

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    model = Regression()
    trainer = pl.Trainer(
        max_epochs=40,
        accelerator="gpu",
        devices=1,
        strategy=ElasticDDPStrategy(commit_every=5),
        plugins=[ElasticEnvironment()],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    prepare_trainer(trainer).fit(model, train_dataloaders=DataLoader(data, batch_size=BATCH, shuffle=True))
    return {
        "global_step": trainer.global_step,
        "devices": elastic.allgather_object(model.trained_on),
        "digests": elastic.allgather_object(_digest(model.parameters())),
    }


def test_lightning_on_the_gpu_goes_on_through_a_sigkill_and_ends_equal(gpu_ray, tmp_path):
    pytest.importorskip("lightning")
    out = _through_a_kill(lightning_train_fn, tmp_path, {}, kill_step=7)
    assert out["global_step"] > 7
    assert len(out["devices"]) == 2, "the replacement did not join before the end"
    assert all(d.startswith("cuda") for d in out["devices"]), out["devices"]
    assert len(set(out["digests"])) == 1, f"ranks diverged: {out['digests']}"


def hf_train_fn(config: dict) -> dict:
    import torch
    import transformers

    import ray_elastic as elastic
    from ray_elastic.transformers import prepare_trainer

    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 64, (96,), generator=g)
    tokens = (starts[:, None] + torch.arange(16)[None, :]) % 64

    class Sequences(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(tokens)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": tokens[i], "labels": tokens[i]}

    class Kill(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _kill_once(config, state.global_step, elastic.rank())

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0, eos_token_id=0
        )
    )
    args = transformers.TrainingArguments(
        output_dir=config["out"],
        max_steps=30,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    trainer = prepare_trainer(
        transformers.Trainer(model=model, args=args, train_dataset=Sequences(), callbacks=[Kill()]), commit_every=5
    )
    trainer.train()
    return {
        "global_step": trainer.state.global_step,
        "devices": elastic.allgather_object(str(next(trainer.model.parameters()).device)),
        "digests": elastic.allgather_object(_digest(trainer.model.parameters())),
    }


def test_the_hf_trainer_on_the_gpu_goes_on_through_a_sigkill_and_ends_equal(gpu_ray, tmp_path):
    pytest.importorskip("transformers")
    out = _through_a_kill(hf_train_fn, tmp_path, {"out": str(tmp_path / "out")}, kill_step=12)
    assert out["global_step"] == 30
    assert all(d.startswith("cuda") for d in out["devices"]), out["devices"]
    assert len(set(out["digests"])) == 1, f"ranks diverged: {out['digests']}"


_OPEN_ON_A_CPU = """
import sys, torch
assert not torch.cuda.is_available()

def tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors(v)

for path in sys.argv[1:]:
    found = list(tensors(torch.load(path, weights_only=True)))
    assert all(t.device.type == "cpu" for t in found), path
print("opened", len(sys.argv) - 1)
"""


def test_a_gpu_run_resumes_from_checkpoint_dir_and_its_checkpoint_opens_on_a_cpu(gpu_ray, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = {
        "min_workers": 2,
        "max_workers": 2,
        "resources_per_worker": {"CPU": 1, "GPU": 0.5},
        "checkpoint_dir": str(ckpt),
        "checkpoint_every": 2,
        "verbose": 0,
    }
    first = ElasticTrainer(amp_train_fn, config={"path": "optimizer", "world": 2, "epochs": 1}, **common).fit()
    assert first.return_value["steps"] == N // (2 * BATCH)
    second = ElasticTrainer(amp_train_fn, config={"path": "optimizer", "world": 2, "epochs": 2}, **common).fit()
    assert "resumed" in [e.kind for e in second.events], second.events
    out = second.return_value
    assert out["steps"] == 2 * N // (2 * BATCH), "the second fit trained the first epoch again"
    assert all(d == ["cpu", "cuda:0"] for d in out["devices"]), out["devices"]
    assert len({str(d) for d in out["digests"]}) == 1
    files = sorted(str(p) for p in Path(second.checkpoint.path).glob("*.pt"))
    assert files, f"no tensor file in {second.checkpoint.path}"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    opened = subprocess.run([sys.executable, "-c", _OPEN_ON_A_CPU, *files], env=env, capture_output=True, text=True)
    assert opened.returncode == 0, opened.stderr[-2000:]
