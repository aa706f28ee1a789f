"""A DDP training run on the workers' GPUs, elastic: `get_device`, `prepare_model`, `prepare_data_loader`.

Each worker asks Ray for `--gpus-per-worker` GPUs (1: NCCL, one rank per
GPU; 0.5: two workers share a GPU and their ring runs Gloo with host
staging). `elastic.torch.get_device()` is the GPU Ray gave the worker, and
the CPU where it has none, so the same script runs on a machine without a
GPU with `--gpus-per-worker 0`; `--smoke` makes it a few seconds' run.

    python examples/gpu_ddp.py --gpus-per-worker 1 --workers 2
    python examples/gpu_ddp.py --gpus-per-worker 0 --smoke      # CPU only

It prints the device the ranks trained on, the loss before and after, and
whether the ranks ended with bitwise-equal parameters.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ray_elastic as elastic

FEATURES = 32


def make_data(samples: int, seed: int) -> TensorDataset:
    """A regression a small MLP can fit: y = sin of a fixed projection of x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    return TensorDataset(x, torch.sin(x @ w))


def digest(model: nn.Module) -> str:
    """The parameters' bytes, hashed on the host: equal on every rank after every sync."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def train_fn(config: dict) -> dict:
    device = elastic.torch.get_device()  # cuda:N on a GPU worker, else cpu
    data = make_data(config["samples"], config["seed"])
    model = nn.Sequential(nn.Linear(FEATURES, config["width"]), nn.ReLU(), nn.Linear(config["width"], 1))
    model = elastic.torch.prepare_model(model)  # moved to device, then DDP over the elastic ring
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])  # after prepare_model: the moved parameters
    loader = elastic.torch.prepare_data_loader(  # batches land on device; exact per epoch through resets
        DataLoader(data, batch_size=config["batch_size"], shuffle=True), seed=config["seed"]
    )
    state = elastic.torch.TorchState(model=model, optimizer=opt, loader=loader, epoch=0, step=0)

    def full_loss() -> float:
        with torch.no_grad():
            x, y = data.tensors
            return nn.functional.mse_loss(model.module(x.to(device)), y.to(device)).item()

    first = full_loss()

    @elastic.run
    def train(state: elastic.torch.TorchState) -> dict:
        while state.epoch < config["epochs"]:
            loader.set_epoch(state.epoch)
            for x, y in loader:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                state.step += 1
                if state.step % 10 == 0:
                    state.commit()
                else:
                    state.check_host_updates()
                elastic.report({"epoch": state.epoch, "step": state.step, "loss": loss.item()})
            state.epoch += 1
            state.commit()
        digests = elastic.allgather_object(digest(model))
        return {"device": str(device), "first_loss": first, "final_loss": full_loss(), "digests": digests}

    return train(state)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus-per-worker", type=float, default=1.0, help="0: CPU workers; 0.5: two share a GPU")
    parser.add_argument("--workers", type=int, default=2, help="the most workers; at least 1 is needed to start")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="a short run: 2 epochs of a small data set")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = {"samples": 4096, "width": 256, "lr": 3e-3, "batch_size": 64, "epochs": args.epochs, "seed": 0}
    if args.smoke:
        config.update(samples=512, width=32, epochs=2)
    resources = {"CPU": 1.0, **({"GPU": args.gpus_per_worker} if args.gpus_per_worker > 0 else {})}
    trainer = elastic.ElasticTrainer(
        train_fn, min_workers=1, max_workers=args.workers, config=config, resources_per_worker=resources
    )
    result = trainer.fit()
    value = result.return_value
    same = len(set(value["digests"])) == 1
    shared = any(e.kind == "backend_changed" for e in result.events)  # ranks on one GPU: Gloo with host staging
    backend = "gloo, ranks sharing a GPU" if shared else trainer.backend
    print(
        f"trained on {value['device']} ({len(value['digests'])} workers, backend {backend}): loss "
        f"{value['first_loss']:.3f} -> {value['final_loss']:.3f}; ranks bitwise equal: {same}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
