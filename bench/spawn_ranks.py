"""Ranks of a benchmark without Ray: one spawned process each, sharing a control directory, reporting on a queue."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(target: Callable[..., None], world: int, args: tuple, messages: int, timeout: float) -> list[Any]:
    """Run `target(rank, world, control_dir, *args, out)` in `world` processes; return the first `messages` puts.

    Each `out.get` waits up to `timeout` s: a rank that dies or hangs fails
    the benchmark with `queue.Empty` instead of blocking it.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as control:
        procs = [ctx.Process(target=target, args=(r, world, control, *args, out)) for r in range(world)]
        for p in procs:
            p.start()
        got = [out.get(timeout=timeout) for _ in range(messages)]
        for p in procs:
            p.join(60)
    return got
