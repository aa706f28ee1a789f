"""Where the elastic optimizer arm's time per step goes: `gpu_overhead.py`'s arms, split by what each one adds.

Same model, batch, AMP, process and blocks as `gpu_overhead.py` (a world
of one, NCCL on a GPU; small and Gloo on the CPU; its options), five arms
against the plain optimizer, 7 alternating rounds of 50 steps by default,
medians:

- plain optimizer: AdamW, a GradScaler, StepLR;
- elastic optimizer: `DistributedOptimizer` + `TorchState`, a commit every 10 steps, checks between;
- wrapper only: the `DistributedOptimizer`, no state;
- plain optimizer + state: the plain optimizer in a `TorchState` (its commits and checks);
- state, no commits: the elastic arm with checks only.

Prints one line per arm (ms per step, ratio to the plain optimizer).

    python bench/gpu_overhead_parts.py [--rounds 7] [--steps 50] [--width 4096] [--depth 8] [--batch 256]
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
    parser = bench.arguments(cuda, __doc__.splitlines()[0])
    parser.set_defaults(rounds=7, steps=50)
    args = parser.parse_args()
    ctx = bench.make_runtime(cuda)
    device = ctx.joined().ring.device if cuda else torch.device("cpu")
    arms = [
        bench.Arm("plain optimizer", "plain_opt", args, device),
        bench.Arm("elastic optimizer", "elastic_opt", args, device),
        bench.Arm("wrapper only", "elastic_opt", args, device),
        bench.Arm("plain optimizer + state", "plain_opt", args, device),
        ChecksOnly("state, no commits", "elastic_opt", args, device),
    ]
    arms[2].state = None
    plain = arms[3]
    plain.state = TorchState(model=plain.model, optimizer=plain.opt, scheduler=plain.sched, scaler=plain.scaler, step=0)
    per_step = bench.per_step_times(arms, args.rounds, args.steps, cuda)
    base = statistics.median(per_step["plain optimizer"])
    for name, times in per_step.items():
        print(f"{name:<26}{statistics.median(times) * 1e3:8.3f} ms  {statistics.median(times) / base:6.3f}x")


if __name__ == "__main__":
    main()
