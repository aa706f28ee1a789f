"""Steady-state throughput: DistributedOptimizer under ElasticTrainer against torch DDP.

Same model, same synthetic data, same world size, one thread per worker,
interleaved (DDP, ours, DDP, ours, ...) in one run so the ratio holds on a
noisy shared machine:

- `ddp`: `torch.nn.parallel.DistributedDataParallel` over Gloo in
  `torch.multiprocessing` processes, no Ray;
- `elastic`: `ray_elastic.torch.DistributedOptimizer` in `ElasticTrainer`
  workers on a local Ray, with `check_host_updates()` every step and
  `commit()` every 10 steps, as a real elastic loop runs.

Samples/s is measured on rank 0 over the steps after a warm-up. Prints a
table and writes bench/results/throughput.json. Reports, never asserts.

    .venv/bin/python bench/throughput.py [--models mlp1m,mlp25m] [--world 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results_file import write_results

MODELS = {"mlp1m": (1024, 896, 1), "mlp25m": (1024, 2048, 6)}  # input width, hidden width, hidden layers
BATCH = 64
WARMUP = 5


def make_model(name: str) -> torch.nn.Module:
    width_in, hidden, depth = MODELS[name]
    layers: list[torch.nn.Module] = [torch.nn.Linear(width_in, hidden), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(hidden, 10))
    return torch.nn.Sequential(*layers)


def batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, MODELS[name][0], generator=g), torch.randint(0, 10, (BATCH,), generator=g)


def _ddp_worker(rank: int, world: int, name: str, steps: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(make_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0.0
    for step in range(steps + WARMUP):
        if step == WARMUP:
            start = time.perf_counter()
        x, y = batch(name, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    elapsed = time.perf_counter() - start
    if rank == 0:
        Path(out).write_text(json.dumps({"samples_per_s": steps * BATCH * world / elapsed}))
    dist.destroy_process_group()


def run_ddp(name: str, world: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_ddp_worker, args=(world, name, steps, os.path.join(tmp, "store"), out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())["samples_per_s"]


def elastic_train_fn(config: dict) -> float:
    import ray_elastic as elastic

    torch.set_num_threads(1)
    torch.manual_seed(0)
    name, steps = config["model"], config["steps"]
    model = make_model(name)
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)

    @elastic.run
    def train(state) -> float:
        start = 0.0
        while state.step < steps + WARMUP:
            if state.step == WARMUP:
                start = time.perf_counter()
            x, y = batch(name, state.step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            if state.step % 10 == 0:
                state.commit()
            else:
                state.check_host_updates()
        return steps * BATCH * elastic.size() / (time.perf_counter() - start)

    return train(state)


def run_elastic(name: str, world: int, steps: int) -> float:
    import ray_elastic as elastic

    trainer = elastic.ElasticTrainer(elastic_train_fn, world, world, config={"model": name, "steps": steps}, verbose=0)
    return trainer.fit().return_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp1m,mlp25m")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    import logging

    import ray

    ray.init(address="local", num_cpus=args.world, logging_level=logging.ERROR, include_dashboard=False)
    rows = []
    for name in args.models.split(","):
        n_params = sum(p.numel() for p in make_model(name).parameters())
        steps = args.steps if n_params < 5e6 else max(10, args.steps // 4)
        ddp, ours = [], []
        for _ in range(args.rounds):
            ddp.append(run_ddp(name, args.world, steps))
            ours.append(run_elastic(name, args.world, steps))
        row = {
            "model": name,
            "params_m": round(n_params / 1e6, 2),
            "world": args.world,
            "steps": steps,
            "ddp_samples_per_s": statistics.median(ddp),
            "elastic_samples_per_s": statistics.median(ours),
            "ddp_rounds": ddp,
            "elastic_rounds": ours,
        }
        row["elastic_over_ddp"] = row["elastic_samples_per_s"] / row["ddp_samples_per_s"]
        rows.append(row)
        print(
            f"{name:>7} ({row['params_m']}M) world {args.world}: DDP {row['ddp_samples_per_s']:8.0f} samples/s, "
            f"ray-elastic {row['elastic_samples_per_s']:8.0f} samples/s, ratio {row['elastic_over_ddp']:.3f}",
            flush=True,
        )
    ray.shutdown()
    write_results("throughput", rows, rounds=args.rounds)


if __name__ == "__main__":
    main()
