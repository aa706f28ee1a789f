"""Steady-state throughput: ray-elastic's two gradient paths against torch DDP and Ray Train.

Same model, same synthetic data, same batch per worker, same world size, one
thread per worker (`torch.set_num_threads(1)` in every rank of every system:
at world size 4 the 4 ranks share this machine's 2 cores, oversubscribed
alike), and every rank at one priority: Ray runs its workers at nice 15, so
the DDP ranks (and this process, which polls) are put at the same niceness.
Four systems:

- `ddp`: `torch.nn.parallel.DistributedDataParallel` over Gloo in
  `torch.multiprocessing` processes, no Ray;
- `elastic`: `ray_elastic.torch.DistributedOptimizer` in `ElasticTrainer`
  workers on a local Ray, with `check_host_updates()` every step and
  `commit()` every 10 steps, as a real elastic loop runs;
- `elastic_ddp`: the same loop with `ray_elastic.torch.prepare_model` (DDP
  over the elastic ring) and a plain `torch.optim.SGD`;
- `raytrain`: Ray Train v2's `TorchTrainer` (`prepare_model`, i.e. DDP over
  the Gloo group Ray Train sets up) on the same local Ray.

For each model and world size the four start side by side once (start-up is
excluded from every figure) and then take turns: in each round every system
runs one window (a warm-up, then `--steps` timed steps on rank 0) while the
others wait idle on a file, in a rotating order. So every ratio compares
windows taken seconds apart, which is what holds on a noisy shared machine.
During each window every thread's CPU time on the machine is read from /proc
(`cpu_account.py`): what the timed ranks used per step, and what everything
else took. Prints tables and writes bench/results/throughput.json. Reports,
never asserts.

    .venv/bin/python bench/throughput.py [--models mlp1m,mlp25m] [--worlds 2,4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from cpu_account import Snapshot, account
from own_dashboard import own_dashboard
from results_file import write_results

MODELS = {"mlp1m": (1024, 896, 1), "mlp25m": (1024, 2048, 6)}  # input width, hidden width, hidden layers
BATCH = 64
WARMUP = 3
POLL_S = 0.02
TURN_TIMEOUT_S = 600.0
SYSTEMS = ("ddp", "elastic", "elastic_ddp", "raytrain")
OURS = ("elastic", "elastic_ddp")
ON_RAY = ("elastic", "elastic_ddp", "raytrain")


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


def wait_file(*paths: str, what: str) -> str:
    """The first of `paths` to exist; waits up to TURN_TIMEOUT_S."""
    deadline = time.monotonic() + TURN_TIMEOUT_S
    while True:
        for p in paths:
            if os.path.exists(p):
                return p
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {TURN_TIMEOUT_S:g} s waiting for {what} ({paths[0]})")
        time.sleep(POLL_S)


def take_turns(system: str, control: str, rank: int, world: int, steps: int, step_fn: Callable[[], None]) -> None:
    """Run one timed window each time the orchestrator says `<system>-go-<k>`, until `<system>-end`."""
    Path(control, f"{system}-pid-{rank}").write_text(str(os.getpid()))  # for the CPU accounting
    if rank == 0:
        Path(control, f"{system}-ready").touch()
    end = os.path.join(control, f"{system}-end")
    k = 0
    while wait_file(os.path.join(control, f"{system}-go-{k}"), end, what=f"{system}'s turn {k}") != end:
        for _ in range(WARMUP):
            step_fn()
        start = time.perf_counter()
        for _ in range(steps):
            step_fn()
        elapsed = time.perf_counter() - start
        if rank == 0:
            done = Path(control, f"{system}-done-{k}")
            done.with_suffix(".tmp").write_text(json.dumps({"samples_per_s": steps * BATCH * world / elapsed}))
            done.with_suffix(".tmp").rename(done)
        k += 1


def sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, name: str, step: int) -> None:
    x, y = batch(name, step)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


# ---- the systems: each runs `take_turns` in every rank ----------------------------------


def _ddp_worker(rank: int, world: int, name: str, steps: int, control: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(control, "ddp-store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(make_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = iter(range(10**9))
    take_turns("ddp", control, rank, world, steps, lambda: sgd_step(model, opt, name, next(counter)))
    dist.destroy_process_group()


def run_ddp(name: str, world: int, steps: int, control: str) -> None:
    mp.spawn(_ddp_worker, args=(world, name, steps, control), nprocs=world, join=True)


def elastic_train_fn(config: dict) -> None:
    """Our elastic loop; `config["ddp"]`: `prepare_model` and a plain optimizer, else `DistributedOptimizer`."""
    import ray_elastic as elastic

    torch.set_num_threads(1)
    torch.manual_seed(0)
    name = config["model"]
    if config["ddp"]:
        model = elastic.torch.prepare_model(make_model(name))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        model = make_model(name)
        opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)
    system = "elastic_ddp" if config["ddp"] else "elastic"

    @elastic.run
    def train(state) -> None:
        def step() -> None:
            sgd_step(model, opt, name, state.step)
            state.step += 1
            if state.step % 10 == 0:
                state.commit()
            else:
                state.check_host_updates()

        take_turns(system, config["control"], elastic.rank(), elastic.size(), config["steps"], step)

    train(state)


def run_elastic(name: str, world: int, steps: int, control: str, ddp: bool = False) -> None:
    import ray_elastic as elastic

    config = {"model": name, "steps": steps, "control": control, "ddp": ddp}
    elastic.ElasticTrainer(elastic_train_fn, world, world, config=config, verbose=0).fit()


def run_elastic_ddp(name: str, world: int, steps: int, control: str) -> None:
    run_elastic(name, world, steps, control, ddp=True)


def raytrain_train_fn(config: dict) -> None:
    """Ray Train's loop: the same model under `prepare_model` (DDP)."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    name = config["model"]
    model = ray.train.torch.prepare_model(make_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    context = ray.train.get_context()
    counter = iter(range(10**9))
    take_turns(
        "raytrain",
        config["control"],
        context.get_world_rank(),
        context.get_world_size(),
        config["steps"],
        lambda: sgd_step(model, opt, name, next(counter)),
    )


def run_raytrain(name: str, world: int, steps: int, control: str) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        raytrain_train_fn,
        train_loop_config={"model": name, "steps": steps, "control": control},
        scaling_config=ScalingConfig(num_workers=world),
        run_config=RunConfig(storage_path=os.path.join(control, "rt-storage")),
    ).fit()


RUNNERS = {"ddp": run_ddp, "elastic": run_elastic, "elastic_ddp": run_elastic_ddp, "raytrain": run_raytrain}


def cpu_summary(windows: list[dict], steps: int) -> dict[str, float]:
    """Medians over a system's windows: its ranks' CPU per step (all ranks together), and the cores
    its ranks and everything else on the machine kept busy while it ran."""

    def median(f: Callable[[dict], float]) -> float:
        return statistics.median(f(w) for w in windows)

    def ranks(w: dict) -> float:
        return w["classes"].get("ranks (timed system)", 0.0)

    return {
        "rank_cpu_ms_per_step": median(lambda w: ranks(w) / (steps + WARMUP) * 1e3),
        "rank_cores": median(lambda w: ranks(w) / w["wall_s"]),
        "rest_cores": median(lambda w: (sum(w["classes"].values()) - ranks(w)) / w["wall_s"]),
        "rank_kernel_ms_per_step": median(lambda w: w["active_kernel_s"] / (steps + WARMUP) * 1e3),
        "rank_faults_per_step": median(lambda w: w["active_minor_faults"] / (steps + WARMUP)),
    }


# ---- the orchestrator ----------------------------------------------------------------------------


def measure(
    name: str, world: int, steps: int, rounds: int, systems: list[str]
) -> tuple[dict[str, list[float]], dict[str, list[dict]]]:
    """Start `systems` side by side, then give each one window per round.

    Returns samples/s per window, and where the machine's CPU went during each window
    (`cpu_account.account`), per system.
    """
    with tempfile.TemporaryDirectory() as control:
        errors: dict[str, BaseException] = {}

        def run(system: str) -> None:
            try:
                RUNNERS[system](name, world, steps, control)
            except BaseException as e:  # noqa: BLE001 - reported to the orchestrator, which stops waiting
                errors[system] = e

        threads = {s: threading.Thread(target=run, args=(s,), daemon=True) for s in systems}
        for t in threads.values():
            t.start()

        def wait_for(path: str, system: str, what: str) -> None:
            deadline = time.monotonic() + TURN_TIMEOUT_S
            while not os.path.exists(path):
                if system in errors:
                    raise RuntimeError(f"{system} failed while waiting for {what}") from errors[system]
                if time.monotonic() > deadline:
                    raise TimeoutError(f"timed out after {TURN_TIMEOUT_S:g} s waiting for {what}")
                time.sleep(POLL_S)

        t0 = time.perf_counter()
        for s in systems:
            wait_for(os.path.join(control, f"{s}-ready"), s, f"{s} to start {world} ranks")
        print(f"{name} world {world}: all systems started in {time.perf_counter() - t0:.1f} s", flush=True)
        for s in systems:
            for r in range(world):
                wait_for(os.path.join(control, f"{s}-pid-{r}"), s, f"{s} rank {r}'s pid")
        pids = {s: {int(Path(control, f"{s}-pid-{r}").read_text()) for r in range(world)} for s in systems}
        samples: dict[str, list[float]] = {s: [] for s in systems}
        cpu: dict[str, list[dict]] = {s: [] for s in systems}
        for rnd in range(rounds):
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]  # rotate who goes first
            for s in order:
                before = Snapshot()
                Path(control, f"{s}-go-{rnd}").touch()
                done = os.path.join(control, f"{s}-done-{rnd}")
                wait_for(done, s, f"{s}'s window {rnd}")
                idle = set().union(*(pids[o] for o in systems if o != s))
                cpu[s].append(account(before, Snapshot(), pids[s], idle))
                samples[s].append(json.loads(Path(done).read_text())["samples_per_s"])
            print(
                f"{name} world {world} round {rnd}: "
                + ", ".join(f"{s} {samples[s][-1]:.0f}" for s in systems)
                + " samples/s",
                flush=True,
            )
        for s in systems:
            Path(control, f"{s}-end").touch()
        for s, t in threads.items():
            t.join(120)
            if t.is_alive() or s in errors:
                raise RuntimeError(f"{s} did not finish cleanly") from errors.get(s)
        return samples, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp1m,mlp25m")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per window (a fifth for the 25M model)")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args()
    import ray

    worlds = [int(w) for w in args.worlds.split(",")]
    systems = args.systems.split(",")
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    # logical CPUs for the Ray systems' ranks side by side (they take turns on the 2 real cores)
    on_ray = sum(s in ON_RAY for s in systems)
    ray.init(address="local", num_cpus=max(1, on_ray) * max(worlds), logging_level=logging.ERROR, **own_dashboard())
    # Ray starts its workers at nice 15 (RAY_worker_niceness): every rank of ray-elastic and of Ray Train
    # runs there. Bare DDP processes would run at 0 and win every wake-up against them (a nice-15 thread
    # gets ~3% of a core beside a nice-0 one), so a poll of this process or a job of another user on the
    # machine would stall our ranks and not DDP's. This process and the DDP ranks it spawns (they inherit
    # it) go to the same niceness, so all three systems' ranks run at one priority. Done after ray.init,
    # so Ray's own processes keep theirs (on Linux a thread's niceness is its own; threads started from
    # here on inherit it).
    niceness = int(os.environ.get("RAY_worker_niceness", "15"))
    os.nice(max(0, niceness - os.nice(0)))
    rows = []
    for name in args.models.split(","):
        n_params = sum(p.numel() for p in make_model(name).parameters())
        steps = args.steps if n_params < 5e6 else max(8, args.steps // 5)
        for world in worlds:
            samples, cpu = measure(name, world, steps, args.rounds, systems)
            row = {"model": name, "params_m": round(n_params / 1e6, 2), "world": world, "steps": steps}
            for s in systems:
                row[f"{s}_samples_per_s"] = statistics.median(samples[s])
                row[f"{s}_rounds"] = samples[s]
                row[f"{s}_cpu"] = cpu[s]
                row.update({f"{s}_{k}": v for k, v in cpu_summary(cpu[s], steps).items()})
            # the ratio of each round's windows (taken seconds apart), then the median over rounds
            for ours in (o for o in OURS if o in systems):
                for other in (o for o in ("ddp", "raytrain") if o in systems):
                    row[f"{ours}_over_{other}"] = statistics.median(
                        e / d for e, d in zip(samples[ours], samples[other], strict=True)
                    )
            rows.append(row)
    ray.shutdown()
    ratios = [f"{o}_over_{b}" for o in OURS for b in ("ddp", "raytrain") if o in systems and b in systems]
    print(
        f"{'model':>7} {'params':>7} {'world':>5} "
        + " ".join(f"{s:>11}" for s in systems)
        + " "
        + " ".join(f"{r:>24}" for r in ratios)
    )
    for row in rows:
        print(
            f"{row['model']:>7} {row['params_m']:>6}M {row['world']:>5} "
            + " ".join(f"{row[f'{s}_samples_per_s']:>11.0f}" for s in systems)
            + " "
            + " ".join(f"{row[r]:>24.3f}" for r in ratios)
        )
    print("where the CPU went during the windows (median over rounds; cores = CPU seconds / wall seconds):")
    print(
        f"{'model':>7} {'world':>5} {'system':>9} {'rank CPU ms/step':>16} {'in kernel':>9} {'faults/step':>11} "
        f"{'ranks, cores':>12} {'rest, cores':>11}"
    )
    for row in rows:
        for s in systems:
            print(
                f"{row['model']:>7} {row['world']:>5} {s:>9} {row[f'{s}_rank_cpu_ms_per_step']:>16.2f} "
                f"{row[f'{s}_rank_kernel_ms_per_step']:>9.2f} {row[f'{s}_rank_faults_per_step']:>11.0f} "
                f"{row[f'{s}_rank_cores']:>12.2f} {row[f'{s}_rest_cores']:>11.2f}"
            )
    write_results("throughput", rows, rounds=args.rounds, threads_per_rank=1, batch_per_rank=BATCH, warmup=WARMUP)


if __name__ == "__main__":
    main()
