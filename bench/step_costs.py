"""What ray-elastic adds to a training step: `report()` and `check_host_updates()`.

- report(): steps/s of the same loop (a small MLP, DistributedOptimizer,
  `check_host_updates()` every step) with and without `elastic.report()` every
  step, in alternating blocks inside one run, world size 2; and the median
  time inside the report() call itself, as a share of a step.
- check_host_updates(): per-call time at world size 4, twice: right after a
  step (the ranks agreed inside the step's gradient allreduce, so no
  collective runs) and bare, with no step before it (one 1-element
  max-allreduce).

Prints tables and writes bench/results/step_costs.json. Reports, never asserts.

    .venv/bin/python bench/step_costs.py [--rounds 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import ray
import torch
from results_file import write_results
from small_mlp import make_mlp

import ray_elastic as elastic


def report_loop(config: dict) -> dict:
    """Steps/s on rank 0 in alternating blocks of `steps` steps: without report(), then with it, ..."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_mlp()
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    @elastic.run
    def train(state) -> dict:
        rates: dict[str, list[float]] = {"without": [], "with": [], "in_report_s": []}
        for block in range(-1, 2 * config["rounds"]):  # block -1 warms up
            report = block % 2 == 1
            start = time.perf_counter()
            for _ in range(config["steps"]):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                state.step += 1
                metrics = {"step": state.step, "loss": loss.item()}
                if report:
                    t0 = time.perf_counter()
                    elastic.report(metrics)
                    rates["in_report_s"].append(time.perf_counter() - t0)
                state.check_host_updates()
            if block >= 0:
                rates["with" if report else "without"].append(config["steps"] / (time.perf_counter() - start))
        return rates

    return train(state)


def check_loop(config: dict) -> dict:
    """Per-call seconds of check_host_updates() after a step and bare."""
    torch.set_num_threads(1)
    model = torch.nn.Linear(16, 4)
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = elastic.torch.TorchState(model=model, optimizer=opt)
    x = torch.randn(8, 16)

    @elastic.run
    def train(state) -> dict:
        after_step, bare = [], []
        for _ in range(config["calls"]):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            t0 = time.perf_counter()
            state.check_host_updates()
            after_step.append(time.perf_counter() - t0)
        for _ in range(config["calls"]):
            t0 = time.perf_counter()
            state.check_host_updates()
            bare.append(time.perf_counter() - t0)
        return {"after_step": after_step, "bare": bare}

    return train(state)


def fit(fn, world: int, config: dict):
    return elastic.ElasticTrainer(fn, world, world, config=config, verbose=0).fit().return_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=4, logging_level=logging.ERROR, include_dashboard=False)
    rates = fit(report_loop, 2, {"steps": args.steps, "rounds": args.rounds})
    report_row = {
        "world": 2,
        "steps": args.steps,
        "steps_per_s_without": statistics.median(rates["without"]),
        "steps_per_s_with_report": statistics.median(rates["with"]),
        "rounds_without": rates["without"],
        "rounds_with": rates["with"],
        "report_call_median_us": statistics.median(rates["in_report_s"]) * 1e6,
    }
    # the call's own share of a step: robust to the machine's noise, unlike the block ratio
    report_row["call_share_of_step"] = report_row["report_call_median_us"] * 1e-6 * report_row["steps_per_s_without"]
    report_row["cost"] = 1 - report_row["steps_per_s_with_report"] / report_row["steps_per_s_without"]
    checks = fit(check_loop, 4, {"calls": args.calls})
    check_row = {
        "world": 4,
        "calls": args.calls,
        "after_step_median_us": statistics.median(checks["after_step"]) * 1e6,
        "after_step_p95_us": sorted(checks["after_step"])[int(0.95 * (args.calls - 1))] * 1e6,
        "bare_median_us": statistics.median(checks["bare"]) * 1e6,
        "bare_p95_us": sorted(checks["bare"])[int(0.95 * (args.calls - 1))] * 1e6,
    }
    ray.shutdown()
    print(
        f"report() every step, world 2: {report_row['steps_per_s_with_report']:.0f} steps/s with, "
        f"{report_row['steps_per_s_without']:.0f} without: cost {report_row['cost'] * 100:+.1f}%; the call itself "
        f"{report_row['report_call_median_us']:.1f} us = {report_row['call_share_of_step'] * 100:.2f}% of a step"
    )
    print(
        f"check_host_updates(), world 4: after a step median {check_row['after_step_median_us']:.1f} us "
        f"(p95 {check_row['after_step_p95_us']:.1f}); bare median {check_row['bare_median_us']:.1f} us "
        f"(p95 {check_row['bare_p95_us']:.1f})"
    )
    write_results("step_costs", [report_row, check_row], rounds=args.rounds)


if __name__ == "__main__":
    main()
