"""Where the elastic optimizer arm's time per step goes: `gpu_overhead.py`'s arms, split by what each one adds.

Same model, batch, AMP and process as `gpu_overhead.py` (a world of one,
NCCL on a GPU; small and Gloo on the CPU), five arms against the plain
optimizer, in alternating blocks of 50 steps, 7 rounds, medians:

- plain optimizer: AdamW, a GradScaler, StepLR;
- elastic optimizer: `DistributedOptimizer` + `TorchState`, a commit every 10 steps, checks between;
- wrapper only: the `DistributedOptimizer`, no state;
- plain optimizer + state: the plain optimizer in a `TorchState` (its commits and checks);
- state, no commits: the elastic arm with checks only.

Prints one line per arm (ms per step, ratio to the plain optimizer).

    python bench/gpu_overhead_parts.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_overhead as bench  # noqa: E402

from ray_elastic.torch import TorchState  # noqa: E402


class ChecksOnly(bench.Arm):
    """The elastic optimizer arm whose steps never reach a commit (a step count that is never a multiple of 10)."""

    def step(self) -> None:
        self.steps = 1
        super().step()


def main() -> None:
    cuda = torch.cuda.is_available()
    shape = {"width": 4096, "depth": 8, "batch": 256} if cuda else {"width": 256, "depth": 4, "batch": 32}
    args = type("Args", (), shape)()
    ctx = bench.make_runtime(cuda)
    device = ctx.group.device if cuda else torch.device("cpu")
    arms = {
        "plain optimizer": bench.Arm("plain optimizer", "plain_opt", args, device),
        "elastic optimizer": bench.Arm("elastic optimizer", "elastic_opt", args, device),
        "wrapper only": bench.Arm("wrapper only", "elastic_opt", args, device),
        "plain optimizer + state": bench.Arm("plain optimizer + state", "plain_opt", args, device),
        "state, no commits": ChecksOnly("state, no commits", "elastic_opt", args, device),
    }
    arms["wrapper only"].state = None
    plain = arms["plain optimizer + state"]
    plain.state = TorchState(model=plain.model, optimizer=plain.opt, scheduler=plain.sched, scaler=plain.scaler, step=0)
    for arm in arms.values():
        for _ in range(12):
            arm.step()
    bench.sync(cuda)
    per_step: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(7):
        for name, arm in list(arms.items())[:: 1 if r % 2 == 0 else -1]:
            per_step[name].append(bench.timed(lambda arm=arm: [arm.step() for _ in range(50)], cuda) / 50)
    base = statistics.median(per_step["plain optimizer"])
    for name, times in per_step.items():
        print(f"{name:<26}{statistics.median(times) * 1e3:8.3f} ms  {statistics.median(times) / base:6.3f}x")


if __name__ == "__main__":
    main()
