"""`prepare_model`: torch's `DistributedDataParallel` on the elastic ring, rebuilt after every reset.

    model = elastic.torch.prepare_model(model, find_unused_parameters=False)

DDP binds itself to one process group, and every reset replaces the ring's
process group (a new generation). So `prepare_model` returns a thin module,
`ElasticDDP`, that holds the user's model as `.module` (as DDP does: its
`state_dict()` keys start with `module.`) and builds a DDP over the current
generation's process group on the first forward (or `no_sync()`) of each
generation; the old one is dropped. Building costs a few milliseconds and one
small collective (DDP's check that every rank holds the same parameter
shapes). DDP's own broadcast of rank 0's parameters is skipped when the run
loop already synced the state in this generation (`TorchState` broadcast
them): a reset costs no second copy of the model.

The gradient reduction runs in DDP's C++ reducer, through a communication
hook that does what DDP's default does (divide by the world size, allreduce
the bucket) and two things more:

- the first bucket carries one extra number, how many ranks hold a
  host-change notice, so the `check_host_updates()` after the step needs no
  collective of its own (as with `DistributedOptimizer`);
- a failed allreduce is recorded in the worker's runtime before DDP raises it
  from `backward()` as a plain `RuntimeError`: the run loop (`@elastic.run`)
  then treats that error as a broken ring (roll back, reset), not as a bug in
  `train_fn`. Collectives DDP runs itself in forward (the buffers' broadcast)
  are caught in `forward()` and raised as `HorovodInternalError`.

Works on the backends whose rings are torch.distributed process groups
(torch Gloo, NCCL). `backend="pygloo"` has no process group: `ElasticTrainer`
refuses a `train_fn` that calls `prepare_model` with it before any worker
starts (it reads the names `train_fn`'s code refers to), and
`prepare_model` itself refuses it in a worker, for a call the trainer
could not see.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ray_elastic.collective.factory import TORCH_BACKENDS
from ray_elastic.exceptions import HorovodInternalError
from ray_elastic.runtime.process import collective_activity, current

# DDP options this wrapper sets itself: the ring's process group, and the initial sync it decides on
_OWN_OPTIONS = ("process_group", "device_mesh", "init_sync")


class ElasticDDP(torch.nn.Module):
    """The user's module (`.module`) and the DDP of the current generation around it.

    Use it as the DDP it stands for: call it, `no_sync()` for gradient
    accumulation, `.module` for the plain model. Its parameters, buffers and
    `state_dict()` are the module's (keys prefixed `module.`, as DDP's), so
    `TorchState(model=prepared)` saves, restores and syncs the module.
    """

    def __init__(self, module: torch.nn.Module, ddp_kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.module = module
        # not attributes torch.nn.Module registers: the DDP must stay out of parameters() and state_dict()
        object.__setattr__(self, "_ddp_kwargs", dict(ddp_kwargs))
        object.__setattr__(self, "_ddp", None)
        object.__setattr__(self, "_generation", -1)
        object.__setattr__(self, "_pending", 0)  # buckets in flight, for the worker's activity marks

    @property
    def ddp(self) -> DistributedDataParallel:
        """The DDP of the current generation (built now if this generation has none yet)."""
        ctx = current()
        ctx.ensure_joined()
        if self._ddp is None or self._generation != ctx.generation:
            object.__setattr__(self, "_ddp", None)  # the old reducer's hooks go with it, before the new ones exist
            object.__setattr__(self, "_ddp", self._build(ctx))
            object.__setattr__(self, "_generation", ctx.generation)
        return self._ddp

    def _build(self, ctx: Any) -> DistributedDataParallel:
        group = ctx.group
        # TorchState's sync already broadcast rank 0's parameters in this generation: skip DDP's second copy
        synced = ctx.membership.synced_generation == ctx.generation
        try:
            ddp = DistributedDataParallel(self.module, init_sync=not synced, **self._ddp_kwargs)
        except Exception as e:
            raise _as_ring_error(e, ctx, "building DistributedDataParallel") from e
        ddp.register_comm_hook(group, self._reduce_bucket)
        return ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ddp = self.ddp
        try:
            return ddp(*args, **kwargs)
        except HorovodInternalError:
            raise
        except Exception as e:
            raise _as_ring_error(e, current(), "DistributedDataParallel's forward") from e

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first one after it reduces them all."""
        with self.ddp.no_sync():
            yield

    # ---- DDP's communication hook (runs in autograd's thread; its callback in the ring's) ----
    # unannotated: DDP compares a hook's annotations with its classes, and this module's annotations are strings
    def _reduce_bucket(self, group, bucket):
        ctx = current()
        generation = ctx.generation
        buffer = bucket.buffer()
        carry = bucket.index() == 0  # every rank's bucket 0 exists every step: the notice rides in it
        scale = 1.0 / group.size
        if carry:
            flat = torch.empty(buffer.numel() + 1, dtype=buffer.dtype, device=buffer.device)
            torch.mul(buffer, scale, out=flat[:-1])
            flat[-1] = 1.0 if ctx.notice > generation else 0.0
        else:
            flat = buffer.mul_(scale) if group.size > 1 else buffer
        if group.size == 1:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(flat)
            fut = done
        else:
            try:
                if group is not ctx.group:
                    raise HorovodInternalError("a gradient bucket of an older ring reached the hook after a reset")
                fut = group.allreduce_future(flat)
            except Exception as e:
                ctx.membership.record_ring_failure(generation, f"gradient allreduce not started: {e}")
                raise
            self._mark_pending(+1)

        def finish(result: torch.futures.Future[Any]) -> torch.Tensor:
            try:
                result.wait()
            except Exception as e:
                ctx.membership.record_ring_failure(generation, f"gradient allreduce failed: {e}")
                raise
            finally:
                if group.size > 1:
                    self._mark_pending(-1)
            if carry:
                ctx.agree_on_notice(bool(flat[-1].item() > 0))
                return flat[:-1]
            return flat

        return fut.then(finish)

    def _mark_pending(self, delta: int) -> None:
        pending = self._pending + delta
        object.__setattr__(self, "_pending", pending)
        if delta > 0 and pending == 1:
            collective_activity(True)  # waiting on the ring inside backward, not stuck in user code
        elif pending == 0:
            collective_activity(False)


def _as_ring_error(e: BaseException, ctx: Any, what: str) -> BaseException:
    """`e` as a `HorovodInternalError` if it came from the ring (a torch.distributed or Gloo error), else `e`."""
    if isinstance(e, HorovodInternalError):
        return e
    broken = ctx.membership.ring_failure()
    if broken is None and (isinstance(e, dist.DistError) or "gloo" in str(e).lower()):
        broken = str(e)
    if broken is None:
        return e
    ctx.membership.record_ring_failure(ctx.generation, f"{what} failed: {broken}")
    return HorovodInternalError(f"{what} failed: {e}")


def prepare_model(model: torch.nn.Module, **ddp_kwargs: Any) -> ElasticDDP:
    """Wrap `model` in DistributedDataParallel over the elastic ring, rebuilt after every reset.

    Call it in `train_fn`, where Ray Train users call
    `ray.train.torch.prepare_model`. Every keyword goes to
    `DistributedDataParallel` (`find_unused_parameters`, `bucket_cap_mb`,
    `gradient_as_bucket_view`, `static_graph`, `broadcast_buffers` ...),
    except `process_group`, `device_mesh` and `init_sync`, which the ring
    decides. Put the returned module in `TorchState(model=...)`; use a plain
    torch optimizer (not `DistributedOptimizer`: DDP already averages the
    gradients).

    Raises:
        ValueError: under `backend="pygloo"`, or for an option the ring sets.
        TypeError: `model` is not a `torch.nn.Module`, or is already wrapped.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model wraps a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, (ElasticDDP, DistributedDataParallel)):
        raise TypeError(f"prepare_model got a model already wrapped in {type(model).__name__}: pass the plain module")
    own = [k for k in _OWN_OPTIONS if k in ddp_kwargs]
    if own:
        raise ValueError(f"prepare_model sets {', '.join(own)} itself (the elastic ring's process group)")
    ctx = current()
    if ctx.settings.backend not in TORCH_BACKENDS:
        raise ValueError(
            f"prepare_model wraps the model in torch DistributedDataParallel, which needs a torch.distributed "
            f"process group, but this run uses backend={ctx.settings.backend!r}: pass backend='gloo' (CPU) or "
            "'nccl' (GPU) to ElasticTrainer, or leave backend='auto'"
        )
    return ElasticDDP(model, ddp_kwargs)
