"""`DistributedOptimizer`: gradient averaging that overlaps backward, across resets.

Parameters are grouped into buckets of about `bucket_cap_mb` (in reverse
order of the optimizer's parameters, which approximates the order in which
backward produces their gradients, as DDP does). A gradient hook counts the
gradients of each bucket; when a bucket is complete, its gradients go into
one flat buffer (divided by the world size, for `Average`) and an
asynchronous allreduce starts while backward goes on. At the end of
backward (an autograd callback, as DDP's) the buckets are waited for: when
`loss.backward()` returns, every `.grad` holds the reduced gradient, as
with DDP. So clipping, `GradScaler` (its plain protocol: `unscale_` reads
the reduced gradients, and a non-finite gradient on any rank is in the sum
on every rank, so every rank skips the same steps) and `step()` need
nothing of their own; `synchronize()` stays for Horovod's scripts.

Each contiguous parameter's `.grad` is then a view into its bucket, as
with DDP's `gradient_as_bucket_view=True`: the next backward accumulates
into it in place when the gradients were zeroed rather than set to None,
and nothing is copied; gradients set to None are copied into their bucket
in one fused call per bucket, and autograd's tensors freed at once, so the
gradients never exist twice. The host work of a step is per bucket (a
copy, a scale, an allreduce, a wait); what stays per parameter is
autograd's hook call, a counter. In a world of one nothing is reduced: the
hooks return at once, no bucket is even allocated, and `step()` steps on
autograd's own gradients.

The hooks stay in at world one (on an H200 taking them out changed
nothing measurable: the elastic arm of bench/gpu_overhead.py was 1.053x a
plain AdamW with them, 1.057x without), because every rank must issue its
allreduces in the same order: with several optimizers, a hooked rank
launches their buckets in autograd's order, and a rank without hooks would
reduce them optimizer by optimizer in `synchronize()`. Equal-sized buckets
would then be summed with the wrong peers, silently (a newcomer made its
optimizers before it joined, unhooked, while the survivors were hooked: the
ranks diverged).

Every allreduce goes through the current generation's ring, so the
optimizer keeps working after each reset; buckets launched in an older
generation are dropped. A ring failure inside backward is recorded and
raised at `step()` (or `synchronize()`) as `HorovodInternalError`, the one
place the run loop expects it.

It is a `torch.optim.Optimizer` (as Horovod's is), so everything made for
one works on it: every LR scheduler, `torch.amp.GradScaler`, hooks, and
`state_dict()`. Its `param_groups`, `state` and `defaults` are the wrapped
optimizer's own objects (a scheduler that changes the LR changes the wrapped
optimizer's), and `state_dict()`, `load_state_dict()`, `zero_grad()` and
`add_param_group()` are the wrapped optimizer's.

The last bucket carries one extra number, how many ranks hold a host-change
notice, so the ranks agree on host updates inside the gradient allreduce and
the `check_host_updates()` that follows `step()` needs no collective of its
own (a check with no step before it still does one). On a GPU that number is
copied to pinned host memory without waiting and read at the next check (at
once at a commit): no step waits for the device (`ray_elastic.torch.notice`).

Buckets live on their parameters' device, with their dtype (a bucket holds
parameters of one device and one dtype), and every collective goes through
the ring's `CollectiveGroup` interface (`allreduce_async`), so the optimizer
runs on every torch backend. The pygloo backend (the numpy-only lane, whose
`allreduce_async` reduces synchronously) is refused at construction with an
error naming the backends to use instead.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd import Variable

from ray_elastic.collective.base import Average, CollectiveWork, ReduceOp, Sum
from ray_elastic.collective.factory import TORCH_BACKENDS
from ray_elastic.exceptions import HorovodInternalError
from ray_elastic.runtime.pace import PACE
from ray_elastic.runtime.process import current, maybe_current
from ray_elastic.torch.notice import NoticeCopy, host_value, reads_later

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ray_elastic.runtime.context import WorkerContext
    from ray_elastic.runtime.generation import Generation


class _Bucket:
    """Parameters of one device and one dtype, and the flat buffer their gradients are reduced in.

    The buffer is made when first used: a world of one never reduces, and
    holds no second copy of the gradients.
    """

    def __init__(self, params: list[torch.Tensor], extra: int = 0) -> None:
        self.params = params
        self.size = sum(p.numel() for p in params) + extra
        self.contiguous = [p.is_contiguous() for p in params]
        self._flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []  # each parameter's gradient in the buffer, shaped as the parameter
        self.ready = 0
        self.work: CollectiveWork | None = None

    @property
    def flat(self) -> torch.Tensor:
        if self._flat is None:
            first = self.params[0]
            flat = torch.zeros(self.size, dtype=first.dtype, device=first.device)
            offset = 0
            for p in self.params:
                self.views.append(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            self._flat = flat
        return self._flat


def _buckets(params: list[torch.Tensor], cap: int) -> list[_Bucket]:
    """`params` in buckets of at most `cap` bytes, each of one dtype and one device, in reverse order.

    Reverse order approximates the order in which backward produces the
    gradients (as DDP does), so the first buckets are launched first.
    """
    buckets: list[_Bucket] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(params):
        if current:
            first = current[0]
            full = size + p.numel() * p.element_size() > cap
            if full or (p.dtype, p.device) != (first.dtype, first.device):
                buckets.append(_Bucket(current))
                current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
    if current:
        buckets.append(_Bucket(current))
    return buckets


def _agree(worker: WorkerContext, notice: torch.Tensor) -> None:
    """Hand the reduced notice count to the runtime: read now on the host, one check later off a device."""
    if reads_later(notice):
        worker.agree_on_notice_deferred(lambda: NoticeCopy(notice).any)
    else:
        worker.agree_on_notice(host_value(notice) > 0)


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer; averages gradients across workers before each step.

    Args:
        optimizer: the optimizer to wrap; its attributes (`param_groups`,
            `state`, `state_dict()` ...) are reachable through this object.
        named_parameters: `model.named_parameters()`, for error messages.
        backward_passes_per_step: local backward passes (gradient
            accumulation) before the allreduce; the accumulated gradient is
            the sum over those passes, as in plain PyTorch accumulation.
        op: `Average` (default) or `Sum` over workers.
        bucket_cap_mb: size of one fused allreduce.
        worker: the worker runtime whose rings reduce the gradients; None
            (the default): this process's, found once, here (its backward
            hooks run inside autograd, where nothing could hand it over).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        bucket_cap_mb: float = 25.0,
        *,
        worker: WorkerContext | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if op not in (Average, Sum):
            raise ValueError(f"op must be Average or Sum, got {op!r}")
        worker = worker if worker is not None else maybe_current()
        if worker is not None and worker.backend not in TORCH_BACKENDS:
            raise ValueError(
                f"DistributedOptimizer needs a torch.distributed backend, but this run uses "
                f"backend={worker.backend!r}: pass backend='gloo' (CPU) or 'nccl' (GPU) to ElasticTrainer, "
                "or average the gradients yourself with ray_elastic.allreduce_"
            )
        self._worker = worker
        self.optimizer = optimizer
        self._as_torch_optimizer()
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        names = {id(p): n for n, p in (named_parameters or [])}
        self._names = {id(p): names.get(id(p), f"param{i}") for i, p in enumerate(params)}
        self._cap = int(bucket_cap_mb * 2**20)
        self._params: list[torch.Tensor] = []
        self._bucket_index: list[int] = []  # by parameter number: its bucket's number
        self._passes: list[int] = []  # by parameter number: backward passes since the last reduction
        self._buckets: list[_Bucket] = []
        self._generation = -1
        self._size = 1
        self._next_launch = 0
        self._backward_passes = 0  # backward passes that reached this optimizer's parameters since the last reduction
        self._queued = False  # this backward's end-of-backward callback is queued
        self._error: BaseException | None = None
        self._reduced = False  # the gradients of this step are reduced: step() steps on them
        self._synchronized = False  # synchronize() was called since the last step (Horovod's skip_synchronize)
        self._add_params(params)

    def _as_torch_optimizer(self) -> None:
        """What `torch.optim.Optimizer.__init__` sets, less the parameters, which stay the wrapped optimizer's."""
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # step hooks and the profiler's step record, as on any optimizer
        self._warned_capturable_if_run_uncaptured = True

    def _add_params(self, params: list[torch.Tensor]) -> None:
        """Bucket `params` (before the last bucket, which carries the host-change count) and hook them."""
        last = [self._buckets.pop()] if self._buckets else []
        added = _buckets(params, self._cap)
        if not last:
            # the last bucket carries one more element: the count of ranks holding a host-change notice,
            # so check_host_updates() after step() agrees through this allreduce instead of its own
            added[-1] = _Bucket(added[-1].params, extra=1)
        self._buckets.extend(added + last)
        where = {id(p): i for i, b in enumerate(self._buckets) for p in b.params}
        for p in params:
            self._params.append(p)
            self._passes.append(0)
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, len(self._params) - 1))
        self._bucket_index = [where[id(p)] for p in self._params]

    # the wrapped optimizer's own objects: its load_state_dict() replaces them, so they are read through each time
    param_groups = property(
        lambda self: self.optimizer.param_groups, lambda self, v: setattr(self.optimizer, "param_groups", v)
    )
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v))
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v))

    def __getattr__(self, name: str) -> Any:
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a DistributedOptimizer is not pickled: keep it in a TorchState, or save its state_dict()")

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters' gradients are reduced like the others'."""
        known = {id(p) for p in self._params}
        self.optimizer.add_param_group(param_group)
        added = [p for p in self.optimizer.param_groups[-1]["params"] if p.requires_grad and id(p) not in known]
        for p in added:
            self._names.setdefault(id(p), f"param{len(self._names)}")
        if added:
            self._add_params(added)  # buckets of their own, before the one that carries the host-change count

    # ---- backward ----------------------------------------------------------
    def _generation_now(self) -> tuple[WorkerContext, Generation]:
        """The worker and the generation it is in (joining first if needed)."""
        if self._worker is None:  # built before the worker's runtime existed: the process's, from now on
            self._worker = current()
        worker = self._worker
        generation = worker.joined()
        if generation.number != self._generation:
            self._follow(generation)
        return worker, generation

    def _follow(self, generation: Generation) -> None:
        """A new generation (a reset): launches of the old ring are void, and the world may have a new size.

        So is an error recorded on the old ring: the reset that replaced it already rolled the step back. With
        several optimizers, each records the broken ring's error in the backward that hit it, and only the first
        one stepped raises it; the others' must not fail the next generation (as the same error twice in a row).
        """
        self._error = None
        self._reset_buckets()
        self._generation = generation.number
        self._size = generation.size
        self._reduced = False

    def _reset_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.work = None
        if self.backward_passes_per_step > 1:
            self._passes = [0] * len(self._passes)
        self._next_launch = 0
        self._backward_passes = 0

    def _on_grad_ready(self, index: int, _param: torch.Tensor) -> None:
        """Autograd accumulated parameter `index`'s gradient: count it, and launch the buckets it completed."""
        try:
            worker, generation = self._generation_now()
            if self._size == 1:
                return  # nothing to reduce: autograd's gradient is the step's
            if not self._queued:
                self._queued = True
                Variable._execution_engine.queue_callback(self._end_of_backward)
            if self.backward_passes_per_step > 1:
                self._passes[index] += 1
                if self._passes[index] != self.backward_passes_per_step:
                    return
            self._buckets[self._bucket_index[index]].ready += 1
            # every rank must issue its collectives in the same order: launch buckets in index order
            buckets = self._buckets
            while self._next_launch < len(buckets) and buckets[self._next_launch].ready == len(
                buckets[self._next_launch].params
            ):
                self._launch(worker, generation, buckets[self._next_launch])
        except BaseException as e:  # noqa: BLE001 - surfaced at step(), not from inside autograd
            self._error = e

    def _end_of_backward(self) -> None:
        """Autograd's callback when a backward that reached these parameters ends: reduce after the last pass."""
        self._queued = False
        if self._error is not None:
            return
        try:
            self._backward_passes += 1
            if self._backward_passes >= self.backward_passes_per_step:
                self._reduce(*self._generation_now())
        except BaseException as e:  # noqa: BLE001 - surfaced at step(), the one place the run loop expects it
            self._error = e

    def _launch(self, worker: WorkerContext, generation: Generation, bucket: _Bucket) -> None:
        self._next_launch += 1
        if bucket is self._buckets[0]:  # buckets launch in index order: the step's compute ends here
            PACE.launched(generation.number)
        ring = generation.ring
        flat = bucket.flat
        moved: list[torch.Tensor] = []  # autograd's gradients, to copy into the bucket in one call
        into: list[torch.Tensor] = []
        unused: list[torch.Tensor] = []  # parameters that got no gradient: zeros in the sum
        for p, view in zip(bucket.params, bucket.views, strict=True):
            grad = p.grad
            if grad is view:
                continue  # accumulated in place in the bucket (gradients zeroed, not set to None)
            if grad is None:
                unused.append(view)
            else:
                moved.append(grad)
                into.append(view)
        with torch.no_grad():
            if moved:
                torch._foreach_copy_(into, moved)
            if unused:
                torch._foreach_zero_(unused)
            # Average divides in the bucket before the sum (as DDP's default hook does): nothing is left to do after
            if self.op is Average:
                flat.mul_(1.0 / self._size)
            if bucket is self._buckets[-1]:
                # fill_ takes the value as a kernel argument; item assignment copies it from pageable host memory,
                # which makes the CPU wait for the device
                flat[-1:].fill_(1.0 if worker.notice > generation.number else 0.0)
        if moved or unused:
            for p, view, contiguous in zip(bucket.params, bucket.views, bucket.contiguous, strict=True):
                # the bucket is the gradient from now on; autograd's tensor is freed here, in backward, so the
                # gradients never exist twice (a non-contiguous parameter keeps its layout: copied back after)
                if contiguous and p.grad is not view:
                    p.grad = view
        bucket.work = ring.allreduce_async(flat, Sum)

    def _reduce(self, worker: WorkerContext, generation: Generation) -> None:
        """Launch what backward did not (parameters with no gradient), wait for every bucket, agree on notices."""
        try:
            for bucket in self._buckets[self._next_launch :]:
                self._launch(worker, generation, bucket)
            for bucket in self._buckets:
                if bucket.work is not None:
                    waiting = time.perf_counter()
                    bucket.work.wait()
                    PACE.waited(time.perf_counter() - waiting)
            _agree(worker, self._buckets[-1].flat[-1:])
            with torch.no_grad():
                for bucket in self._buckets:
                    for p, view, contiguous in zip(bucket.params, bucket.views, bucket.contiguous, strict=True):
                        if contiguous:
                            continue
                        if p.grad is None:
                            p.grad = view.clone()  # keeps autograd's layout for a non-contiguous parameter
                        else:
                            p.grad.copy_(view)
        finally:
            self._reset_buckets()
        PACE.reduced(generation.number)
        self._reduced = True

    # ---- step ------------------------------------------------------------
    def synchronize(self) -> None:
        """Have the reduced gradients in `.grad` now (backward's end already did, unless no gradient came)."""
        worker, generation = self._generation_now()
        try:
            if self._error is not None:
                self._reset_buckets()  # what backward launched before it failed is void
                raise self._error
            if not self._reduced:
                if self._size > 1:
                    self._reduce(worker, generation)
                else:
                    PACE.launched(generation.number)
                    worker.agree_on_notice(worker.notice > generation.number)  # alone: nothing to agree with
                    PACE.reduced(generation.number)
                    self._reduced = True
        except HorovodInternalError:
            raise
        except RuntimeError as e:
            raise HorovodInternalError(f"gradient allreduce failed: {e}") from e
        finally:
            self._error = None
            self._queued = False
        self._synchronized = True

    def step(self, closure: Any = None) -> Any:
        """Step the wrapped optimizer on the reduced gradients (reducing first if backward did not)."""
        if not self._reduced or self._error is not None:
            self.synchronize()
        self._reduced = False
        self._synchronized = False
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = False
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, buckets={len(self._buckets)})"
