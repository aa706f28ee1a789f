"""How many threads a worker's torch uses: the CPUs reserved for it, unless the user chose.

Ray sets `OMP_NUM_THREADS` in a worker process to the CPUs its actor asked
of Ray, and to 1 when it asked for none. A Tune trial's workers ask for
none (they run on the trial's reservation, `tune/placement.py`), so torch
ran one intra-op thread whatever `resources_per_worker` reserved. The
worker therefore sets the thread count to the CPUs reserved for it
(`WorkerConfig.cpus`), in trials and outside them, unless the user set
`OMP_NUM_THREADS`: in `fit()`'s environment, in the job's `runtime_env`,
or in the node's environment (a value other than the one Ray would set).
"""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from collections.abc import Mapping


def ray_default_threads(assigned_cpus: float | None) -> int:
    """What Ray sets `OMP_NUM_THREADS` to when nobody set it: the actor's whole CPUs, at least 1."""
    return max(1, math.floor(assigned_cpus or 1))


def intra_op_threads(
    reserved_cpus: float, env_value: str | None, ray_default: int, user_set: bool = False
) -> int | None:
    """The threads torch should run, or None to leave the user's choice.

    `env_value` is the process's `OMP_NUM_THREADS`: a value other than
    `ray_default` was set by someone other than Ray, i.e. the user.
    """
    if user_set or (env_value is not None and env_value != str(ray_default)):
        return None
    return max(1, math.floor(reserved_cpus))


def apply_threads(reserved_cpus: float, user_set: bool) -> int | None:
    """Set this worker process's threads (before `train_fn` imports torch, and in torch if it is imported).

    Returns the count set, or None where the user's `OMP_NUM_THREADS` holds.
    """
    context = ray.get_runtime_context()
    env_vars: Mapping[str, str] = (context.runtime_env or {}).get("env_vars") or {}
    ray_default = ray_default_threads(context.get_assigned_resources().get("CPU"))
    threads = intra_op_threads(
        reserved_cpus, os.environ.get("OMP_NUM_THREADS"), ray_default, user_set or "OMP_NUM_THREADS" in env_vars
    )
    if threads is None:
        return None
    os.environ["OMP_NUM_THREADS"] = str(threads)  # torch reads it at import; so do subprocesses (loader workers)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    return threads
