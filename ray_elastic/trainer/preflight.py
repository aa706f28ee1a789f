"""The checks `ElasticTrainer` makes before anything is spawned.

Each raises a `ValueError` that says what is wrong, in the user's terms:
`train_fn` that would run nothing or cannot work with the backend, a dataset
name `train_fn` asks for and was not given, resources no node of the
cluster holds, a checkpoint directory that cannot be written. A check
that needs the cluster runs in `fit()`, once Ray is up; the others run in
the constructor. `data_cpus_line` says, before training, what a run with
datasets keeps for its data pipeline.
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ray_elastic.checkpoint import CheckpointError, CheckpointStore, bounded_call
from ray_elastic.discovery import alive_ray_nodes, keep_cpus_free, slots_for_resources

if TYPE_CHECKING:
    from ray_elastic.config import RunConfig

logger = logging.getLogger("ray_elastic.trainer")


def check_train_fn(train_fn: Any, backend: str) -> None:
    """`train_fn` is a plain callable, and does not ask for what `backend` lacks."""
    if not callable(train_fn):
        raise ValueError(f"train_fn must be callable, got {type(train_fn).__name__}")
    if inspect.iscoroutinefunction(train_fn) or inspect.isasyncgenfunction(train_fn):
        raise ValueError("train_fn must be a plain function: an async def runs nothing until awaited")
    if inspect.isgeneratorfunction(train_fn):
        raise ValueError("train_fn must be a plain function: a generator function runs nothing until iterated")
    if backend == "pygloo" and refers_to(train_fn, "prepare_model"):
        raise ValueError(
            "train_fn calls prepare_model, which wraps the model in torch DistributedDataParallel and needs a "
            "torch.distributed process group; backend='pygloo' has none: pass backend='gloo' (CPU) or "
            "'nccl' (GPU), or leave backend='auto'"
        )


def check_config(config: Any) -> None:
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")


def check_verbose(verbose: Any) -> None:
    """`verbose` is 0 or 1 (True and False too): anything else would be taken for one of them without a word."""
    if not isinstance(verbose, (int, float)) or verbose not in (0, 1):
        raise ValueError(f"verbose must be 0 (no progress bar, no event lines) or 1 (both), got {verbose!r}")


def check_dataset_names(train_fn: Callable[..., Any], datasets: Mapping[str, Any]) -> None:
    """Every name `train_fn` passes to `get_dataset_shard` as a literal is one of `datasets`.

    A wrapper around the user's loop (`ray_elastic.train`'s) is seen through as a `functools.partial` is (its
    `func`), and names the loop and the trainer in the error as the user wrote them (its `names_in_errors`).
    """
    asked = dataset_names_asked(train_fn)
    if asked - set(datasets):
        fn_name, trainer_name = getattr(train_fn, "names_in_errors", ("train_fn", "ElasticTrainer"))
        given = f"datasets {sorted(datasets)}" if datasets else "no datasets="
        raise ValueError(
            f"{fn_name} asks get_dataset_shard for {sorted(asked - set(datasets))}, but {trainer_name} was given "
            f"{given}"
        )


def check_cluster_can_hold_a_worker(cfg: RunConfig) -> None:
    """Some node of the Ray cluster holds one worker's resources (and a GPU where the workers ask for one)."""
    nodes = alive_ray_nodes()
    if cfg.resources_per_worker.get("GPU", 0) > 0 and not any(n.resources.get("GPU", 0) > 0 for n in nodes):
        raise ValueError(
            f"backend={cfg.backend!r} with resources_per_worker={cfg.resources_per_worker} "
            "needs GPUs, but no node of the Ray cluster has one"
        )
    if not any(slots_for_resources(n.resources, cfg.resources_per_worker) for n in nodes):
        totals = [dict(n.resources) for n in nodes]
        raise ValueError(
            f"resources_per_worker={cfg.resources_per_worker} fits on no node of the Ray cluster "
            f"(node resources: {totals})"
        )


def check_checkpoint_dir(cfg: RunConfig, verbose: int) -> None:
    """Prove the checkpoint directory usable before anything starts, and say if the run resumes."""
    if cfg.checkpoint_dir is None:
        return
    store = CheckpointStore(cfg.checkpoint_dir)

    def probe() -> dict[str, Any] | None:
        store.check_writable()
        store.refuse_old_format()
        return store.meta()

    try:
        # storage that hangs (a dead mount) must not hang fit(): bounded as the driver's own look at it
        meta = bounded_call(cfg.discovery_timeout, f"checking {store.url!r} (discovery_timeout)", probe)
    except CheckpointError as e:
        raise ValueError(str(e)) from e
    if meta is not None and verbose:
        logger.warning(
            "resuming from the checkpoint in %s (commit %s, world size %s)",
            cfg.checkpoint_dir,
            meta.get("commit"),
            meta.get("world_size"),
        )


def data_cpus_line(cfg: RunConfig) -> str:
    """What a run with datasets keeps for its data pipeline, and why: the line `fit()` shows before training."""
    if cfg.kept_cpus == 0:
        return (
            "[ray-elastic] data_cpus=0: the workers may take every CPU of the cluster; a dataset that then "
            f"produces nothing for {cfg.data_starvation_timeout:g} s fails the run"
        )
    nodes = alive_ray_nodes()
    per_worker = cfg.resources_per_worker
    slots = {n.node_id: slots_for_resources(n.resources, per_worker) for n in nodes}
    kept = sum(keep_cpus_free(slots, nodes, per_worker.get("CPU", 0.0), cfg.kept_cpus).values())
    line = (
        f"[ray-elastic] keeping {cfg.kept_cpus} CPU(s) of the cluster free for Ray Data's read and map tasks "
        f"(data_cpus={cfg.kept_cpus}; workers holding every CPU would starve the dataset): "
        f"{kept} worker slot(s) of the {sum(slots.values())} the cluster holds"
    )
    if kept < cfg.min_workers:
        line += f"; fewer than min_workers={cfg.min_workers}: the run waits up to elastic_timeout for more nodes"
    return line


def _plain_function(fn: Callable[..., Any]) -> types.FunctionType | None:
    """The Python function behind `fn` (through functools.partial, decorators, a callable object), if any."""
    fn = inspect.unwrap(getattr(fn, "func", fn))
    if not isinstance(fn, types.FunctionType):
        fn = inspect.getattr_static(type(fn), "__call__", None)
    return fn if isinstance(fn, types.FunctionType) else None


def dataset_names_asked(fn: Callable[..., Any]) -> set[str]:
    """The names `fn` passes to `get_dataset_shard` as a literal first argument (its own code and nested code).

    Lets the trainer refuse an unknown name before any worker starts; a name
    computed at run time is left to `get_dataset_shard`'s own error.
    """
    import dis

    plain = _plain_function(fn)
    if plain is None:
        return set()
    names: set[str] = set()
    todo, seen = [plain.__code__], set()
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
        ops = [i for i in dis.get_instructions(code) if i.opname not in ("PUSH_NULL", "CACHE", "PRECALL")]
        for this, after in zip(ops, ops[1:], strict=False):
            if this.argval == "get_dataset_shard" and this.opname.startswith("LOAD_") and after.opname == "LOAD_CONST":
                if isinstance(after.argval, str):
                    names.add(after.argval)
    return names


def refers_to(fn: Callable[..., Any], name: str, depth: int = 3) -> bool:
    """Whether `fn`'s code, or that of a function of its own module it calls, refers to `name`.

    Reads the names in the bytecode (nested functions included; a global and
    an attribute alike, so `elastic.torch.prepare_model` counts), following
    module-level functions of `fn`'s module up to `depth` calls deep. Lets
    the trainer refuse a combination before any worker starts; a reference it
    cannot see (through another module) is left to the worker's own check.
    """
    plain = _plain_function(fn)
    if plain is None:
        return False
    seen: set[types.CodeType] = set()
    todo = [(plain.__code__, 0)]
    while todo:
        code, level = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        if name in code.co_names:
            return True
        todo += [(c, level) for c in code.co_consts if isinstance(c, types.CodeType)]
        if level < depth:
            for called in code.co_names:
                callee = plain.__globals__.get(called)
                if isinstance(callee, types.FunctionType) and callee.__module__ == plain.__module__:
                    todo.append((callee.__code__, level + 1))
    return False
