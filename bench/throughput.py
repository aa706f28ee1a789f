"""Steady-state throughput: DistributedOptimizer under ElasticTrainer against torch DDP and Ray Train.

Same model, same synthetic data, same batch per worker, same world size, one
thread per worker (`torch.set_num_threads(1)` in every rank of every system:
at world size 4 the 4 ranks share this machine's 2 cores, oversubscribed
alike), interleaved in one run (every round runs each system once per model
and world size, in a rotating order) so the ratios hold on a noisy machine:

- `ddp`: `torch.nn.parallel.DistributedDataParallel` over Gloo in
  `torch.multiprocessing` processes, no Ray;
- `elastic`: `ray_elastic.torch.DistributedOptimizer` in `ElasticTrainer`
  workers on a local Ray, with `check_host_updates()` every step and
  `commit()` every 10 steps, as a real elastic loop runs;
- `raytrain`: Ray Train v2's `TorchTrainer` (`prepare_model`, i.e. DDP over
  the Gloo group Ray Train sets up) on the same local Ray.

Samples/s is measured inside the training loop on rank 0 over the steps after
a warm-up, the same way in all three: start-up (processes, actors, process
group) is excluded. Prints a table and writes bench/results/throughput.json.
Reports, never asserts.

    .venv/bin/python bench/throughput.py [--models mlp1m,mlp25m] [--worlds 2,4] [--rounds 3]
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


def raytrain_train_fn(config: dict) -> None:
    """Ray Train's loop: the same model under `prepare_model` (DDP), rank 0 writes its samples/s."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    name, steps = config["model"], config["steps"]
    model = ray.train.torch.prepare_model(make_model(name))
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
    context = ray.train.get_context()
    if context.get_world_rank() == 0:
        samples_per_s = steps * BATCH * context.get_world_size() / elapsed
        Path(config["out"]).write_text(json.dumps({"samples_per_s": samples_per_s}))


def run_raytrain(name: str, world: int, steps: int) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        TorchTrainer(
            raytrain_train_fn,
            train_loop_config={"model": name, "steps": steps, "out": out},
            scaling_config=ScalingConfig(num_workers=world),
            run_config=RunConfig(storage_path=os.path.join(tmp, "storage")),
        ).fit()
        return json.loads(Path(out).read_text())["samples_per_s"]


SYSTEMS = {"ddp": run_ddp, "elastic": run_elastic, "raytrain": run_raytrain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp1m,mlp25m")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="measured steps of the small model (a quarter for 25M)")
    parser.add_argument("--systems", default="ddp,elastic,raytrain")
    args = parser.parse_args()
    import logging

    import ray

    worlds = [int(w) for w in args.worlds.split(",")]
    systems = args.systems.split(",")
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    ray.init(address="local", num_cpus=max(worlds), logging_level=logging.ERROR, include_dashboard=False)
    configs = []
    for name in args.models.split(","):
        n_params = sum(p.numel() for p in make_model(name).parameters())
        steps = args.steps if n_params < 5e6 else max(10, args.steps // 4)
        configs += [(name, n_params, world, steps) for world in worlds]
    samples: dict[tuple[str, int, str], list[float]] = {}
    for rnd in range(args.rounds):
        for name, _, world, steps in configs:
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]  # rotate who goes first
            for system in order:
                t0 = time.perf_counter()
                value = SYSTEMS[system](name, world, steps)
                samples.setdefault((name, world, system), []).append(value)
                print(
                    f"round {rnd}: {name} world {world} {system}: {value:.0f} samples/s "
                    f"(whole run with start-up {time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
    ray.shutdown()
    rows = []
    for name, n_params, world, steps in configs:
        row = {"model": name, "params_m": round(n_params / 1e6, 2), "world": world, "steps": steps}
        for system in systems:
            row[f"{system}_samples_per_s"] = statistics.median(samples[(name, world, system)])
            row[f"{system}_rounds"] = samples[(name, world, system)]
        if "ddp" in systems and "elastic" in systems:
            row["elastic_over_ddp"] = row["elastic_samples_per_s"] / row["ddp_samples_per_s"]
        if "raytrain" in systems and "elastic" in systems:
            row["elastic_over_raytrain"] = row["elastic_samples_per_s"] / row["raytrain_samples_per_s"]
        rows.append(row)
    print(f"{'model':>7} {'params':>7} {'world':>5} " + " ".join(f"{s:>10}" for s in systems) + "  ours/DDP  ours/RT")
    for row in rows:
        over_ddp, over_rt = row.get("elastic_over_ddp", float("nan")), row.get("elastic_over_raytrain", float("nan"))
        print(
            f"{row['model']:>7} {row['params_m']:>6}M {row['world']:>5} "
            + " ".join(f"{row[f'{s}_samples_per_s']:>10.0f}" for s in systems)
            + f"  {over_ddp:>8.3f} {over_rt:>8.3f}"
        )
    write_results("throughput", rows, rounds=args.rounds, threads_per_rank=1, batch_per_rank=BATCH, warmup=WARMUP)


if __name__ == "__main__":
    main()
