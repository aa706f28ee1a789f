"""The digits example as a Ray Job: submitted to a running cluster, elastic inside it.

    export RAY_AUTH_MODE=token                  # Ray's token authentication
    ray get-auth-token --generate > /dev/null   # writes ~/.ray/auth_token once
    export RAY_AUTH_TOKEN=$(ray get-auth-token)
    ray start --head --num-cpus 3
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python examples/job.py --epochs 3 --crash-at-step 30

The job's driver connects to the cluster the job runs on (Ray sets
`RAY_ADDRESS` for it), trains `examples/digits.py` on as many workers as the
cluster holds (between `--min-workers` and `--max-workers`), and prints each
membership event as it completes, so `ray job logs` shows the start, every
recovery and the result. `--crash-at-step N` SIGKILLs one worker once, at
step N, to see a recovery happen (the once-only marker is a file in the
node's temp dir, so on a multi-node cluster it fires at most once per node).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from digits import train_fn  # noqa: E402

import ray_elastic as elastic  # noqa: E402


class CrashOnce:
    """A step hook: the worker of rank 1 SIGKILLs itself at `step`, once per run."""

    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = marker

    def __call__(self, step: int) -> None:
        if step != self.step or elastic.rank() != 1:
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return  # crashed already; the survivors are replaying this step after the rollback
        os.kill(os.getpid(), signal.SIGKILL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-workers", type=int, default=2)
    parser.add_argument("--max-workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--crash-at-step", type=int, default=None, metavar="N", help="SIGKILL one worker at step N")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the bar is off when stdout is a log file; event lines come through logging
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    logging.getLogger("ray_elastic").setLevel(logging.INFO)
    config: dict = {"epochs": args.epochs}
    if args.crash_at_step is not None:
        marker = os.path.join(tempfile.gettempdir(), f"ray-elastic-job-crash-{uuid.uuid4().hex}")
        config["step_hook"] = CrashOnce(args.crash_at_step, marker)
    result = elastic.ElasticTrainer(
        train_fn, min_workers=args.min_workers, max_workers=args.max_workers, config=config
    ).fit()
    value = result.return_value
    print(f"events: {[(e.kind, e.world_size) for e in result.events]}")
    print(f"test accuracy {value['accuracy']:.3f} after {value['steps']} steps on {value['world_size']} workers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
