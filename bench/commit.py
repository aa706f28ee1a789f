"""What a commit costs: `TorchState.save()` against a plain copy and a deepcopy.

For a model plus Adam state of 10M, 50M and 100M parameters (Adam's two
moments make the state three times the model), in one process, side by
side:

- `copy_`: a plain `Tensor.copy_` of the same tensors into preallocated
  buffers: the floor any in-memory commit has to pay;
- `TorchState.save()`: the in-memory half of `commit()` (the other half,
  `check_host_updates()`, is one tiny allreduce, measured in bench/);
- `deepcopy`: `copy.deepcopy` of the model's and optimizer's state dicts, as
  Horovod's TorchState does.

Prints a table and writes bench/results/commit.json (or `--out NAME`). Reports,
never asserts.

    .venv/bin/python bench/commit.py [--sizes 10,50,100] [--reps 5] [--out commit]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from results_file import write_results

from ray_elastic.torch.state import TorchState


def make(params_m: int, width: int = 1024) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of about `params_m` million parameters, with Adam state created."""
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = list(model.parameters()) + list(model.buffers())
    for st in opt.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


def timed(fn, reps: int) -> float:
    fn()  # first call allocates; steady state is what a training loop pays
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,50,100", help="millions of model parameters")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="commit", help="results file name under bench/results/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        model, opt = make(size)
        tensors = state_tensors(model, opt)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        dest = [torch.empty_like(t) for t in tensors]

        def plain_copy(tensors=tensors, dest=dest) -> None:
            for d, t in zip(dest, tensors, strict=True):
                d.copy_(t)

        state = TorchState(model=model, optimizer=opt, epoch=0)
        copy_s = timed(plain_copy, args.reps)
        save_s = timed(state.save, args.reps)
        deep_s = timed(lambda m=model, o=opt: (copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict())), args.reps)
        n_params = sum(p.numel() for p in model.parameters())
        rows.append(
            {
                "params_m": round(n_params / 1e6, 1),
                "state_mb": round(nbytes / 2**20),
                "copy_s": copy_s,
                "torchstate_save_s": save_s,
                "deepcopy_s": deep_s,
                "save_over_copy": save_s / copy_s,
                "deepcopy_over_save": deep_s / save_s,
            }
        )
        del model, opt, tensors, dest, state
    print(f"{'params':>8} {'state':>8} {'copy_':>9} {'save()':>9} {'deepcopy':>9} {'save/copy':>10} {'deep/save':>10}")
    for r in rows:
        print(
            f"{r['params_m']:>7}M {r['state_mb']:>6}MB {r['copy_s'] * 1e3:>7.1f}ms "
            f"{r['torchstate_save_s'] * 1e3:>7.1f}ms {r['deepcopy_s'] * 1e3:>7.1f}ms "
            f"{r['save_over_copy']:>9.2f}x {r['deepcopy_over_save']:>9.2f}x"
        )
    write_results(args.out, rows, reps=args.reps, sizes=args.sizes)


if __name__ == "__main__":
    main()
