"""`DistributedOptimizer`: gradient averaging that overlaps backward, across resets.

Parameters are grouped into buckets of about `bucket_cap_mb` (in reverse
order of the optimizer's parameters, which approximates the order in which
backward produces their gradients, as DDP does). A gradient hook counts the
gradients of each bucket; when a bucket is complete, its gradients are
copied into one flat buffer (divided by the world size on the way, for
`Average`) and an asynchronous allreduce starts while backward goes on.
`step()` (or `synchronize()`) waits for the buckets and steps the wrapped
optimizer. Each contiguous parameter's `.grad` is then a view into its
bucket, as with DDP's `gradient_as_bucket_view=True`: nothing is copied
back, and a step whose grads were kept (zeroed, not set to None) copies
nothing in either. Autograd's own gradient tensor is freed as soon as it is
copied into its launched bucket, in backward, so the gradients never exist
twice; from then until `synchronize()` that `.grad` is None (the bucket is
being reduced: nothing may write it). The next step overwrites the bucket,
so a `.grad` kept past the next step must be cloned.

Every allreduce goes through the current generation's ring, so the
optimizer keeps working after each reset; buckets launched in an older
generation are dropped. A ring failure inside a hook is recorded and raised
at `step()` as `HorovodInternalError`, the one place the run loop expects it.

It is a `torch.optim.Optimizer` (as Horovod's is), so everything made for
one works on it: every LR scheduler, `torch.amp.GradScaler`, hooks, and
`state_dict()`. Its `param_groups`, `state` and `defaults` are the wrapped
optimizer's own objects (a scheduler that changes the LR changes the wrapped
optimizer's), and `state_dict()`, `load_state_dict()`, `zero_grad()` and
`add_param_group()` are the wrapped optimizer's. After `synchronize()` the
gradients are the reduced ones and the next `step()` steps on them without
reducing again: clip between the two. A `GradScaler` hands itself to
`step()` (`_step_supports_amp_scaling`), which reduces the scaled gradients
first and unscales and checks them after: a non-finite gradient on any rank
is in the sum on every rank, so every rank skips the same steps.

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

import time
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

from ray_elastic.collective.base import Average, CollectiveWork, ReduceOp, Sum
from ray_elastic.collective.factory import TORCH_BACKENDS
from ray_elastic.exceptions import HorovodInternalError
from ray_elastic.runtime.pace import PACE
from ray_elastic.runtime.process import current, maybe_current
from ray_elastic.torch.notice import NoticeCopy, host_value, reads_later

if TYPE_CHECKING:
    from collections.abc import Iterable


class _Bucket:
    """Parameters of one device and one dtype, and the flat buffer their gradients are reduced in."""

    def __init__(self, params: list[torch.Tensor], extra: int = 0) -> None:
        self.params = params
        first = params[0]
        self.flat = torch.zeros(sum(p.numel() for p in params) + extra, dtype=first.dtype, device=first.device)
        self.ready = 0
        self.work: CollectiveWork | None = None


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


def _agree(ctx: Any, notice: torch.Tensor) -> None:
    """Hand the reduced notice count to the runtime: read now on the host, one check later off a device."""
    if reads_later(notice):
        ctx.agree_on_notice_deferred(lambda: NoticeCopy(notice).any)
    else:
        ctx.agree_on_notice(host_value(notice) > 0)


# GradScaler warns that it will stop handing itself to step(); until then that is how the reduction comes first
warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself", category=FutureWarning)


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
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        backward_passes_per_step: int = 1,
        op: ReduceOp = Average,
        bucket_cap_mb: float = 25.0,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int):
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if op not in (Average, Sum):
            raise ValueError(f"op must be Average or Sum, got {op!r}")
        ctx = maybe_current()
        if ctx is not None and ctx.backend not in TORCH_BACKENDS:
            raise ValueError(
                f"DistributedOptimizer needs a torch.distributed backend, but this run uses "
                f"backend={ctx.backend!r}: pass backend='gloo' (CPU) or 'nccl' (GPU) to ElasticTrainer, "
                "or average the gradients yourself with ray_elastic.allreduce_"
            )
        self.optimizer = optimizer
        self._as_torch_optimizer()
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        names = {id(p): n for n, p in (named_parameters or [])}
        self._names = {p: names.get(id(p), f"param{i}") for i, p in enumerate(params)}
        self._cap = int(bucket_cap_mb * 2**20)
        self._buckets = _buckets(params, self._cap)
        # the last bucket carries one more element: the count of ranks holding a host-change notice,
        # so check_host_updates() after step() agrees through this allreduce instead of its own
        last = self._buckets[-1]
        self._buckets[-1] = _Bucket(last.params, extra=1)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._passes = {p: 0 for p in params}
        self._generation = -1
        self._next_launch = 0
        self._error: BaseException | None = None
        self._synchronized = False  # synchronize() ran since the last step: step() uses the reduced gradients
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

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

    # the wrapped optimizer's own objects: its load_state_dict() replaces them, so they are read through each time
    param_groups = property(
        lambda self: self.optimizer.param_groups, lambda self, v: setattr(self.optimizer, "param_groups", v)
    )
    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v))
    defaults = property(lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v))
    _step_supports_amp_scaling = True  # GradScaler.step hands itself to step(): reduce first, then unscale

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
        known = set(self._passes)
        self.optimizer.add_param_group(param_group)
        added = [p for p in self.optimizer.param_groups[-1]["params"] if p.requires_grad and p not in known]
        if not added:
            return
        for p in added:
            self._names.setdefault(p, f"param{len(self._names)}")
            self._passes[p] = 0
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))
        # the new parameters get buckets of their own, before the one that carries the host-change count
        last = self._buckets.pop()
        self._buckets.extend(_buckets(added, self._cap))
        self._buckets.append(last)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}

    # ---- hooks ---------------------------------------------------------
    def _reset_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.ready = 0
            bucket.work = None
        for p in self._passes:
            self._passes[p] = 0
        self._next_launch = 0

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        try:
            ctx = current()
            ctx.ensure_joined()
            if ctx.generation != self._generation:
                self._reset_buckets()  # a reset happened: launches of the old ring are void
                self._generation = ctx.generation
            self._passes[p] += 1
            if self._passes[p] != self.backward_passes_per_step:
                return
            self._bucket_of[p].ready += 1
            # every rank must issue its collectives in the same order: launch buckets in index order
            while self._next_launch < len(self._buckets):
                bucket = self._buckets[self._next_launch]
                if bucket.ready < len(bucket.params):
                    break
                self._launch(bucket)
        except BaseException as e:  # noqa: BLE001 - surfaced at step(), not from inside autograd
            self._error = e

    def _launch(self, bucket: _Bucket) -> None:
        self._next_launch += 1
        ctx = current()
        if bucket is self._buckets[0]:  # buckets launch in index order: the step's compute ends here
            PACE.launched(ctx.generation)
        slot, ring = ctx.slot, ctx.group
        assert slot is not None and ring is not None  # a backward of a joined rank launches buckets
        size = slot.size
        # Average divides while copying into the bucket (one pass, as DDP's default hook divides before
        # its allreduce), so nothing is left to do to the sum but hand it back
        scale = 1.0 / size if self.op is Average and size > 1 else None
        offset = 0
        with torch.no_grad():
            for p in bucket.params:
                n = p.numel()
                dst = bucket.flat[offset : offset + n]
                grad = p.grad
                if grad is None:
                    dst.zero_()
                elif grad.data_ptr() == dst.data_ptr() and grad.is_contiguous():
                    # still the bucket's view from the last step (grads kept, not set to None): in place
                    if scale is not None:
                        dst.mul_(scale)
                else:
                    if scale is not None:
                        torch.mul(grad.reshape(-1), scale, out=dst)
                    else:
                        dst.copy_(grad.reshape(-1))
                    if p.is_contiguous():
                        # autograd's tensor is copied: free it now, not at step(). Held until then, every
                        # gradient existed twice at the end of backward (4 bytes per parameter more at peak).
                        # None, not the bucket's view, until step(): the bucket is being reduced, and a
                        # .grad written meanwhile (a clip before synchronize(), a second backward) would
                        # race the allreduce and could leave the ranks with different gradients
                        p.grad = None
                offset += n
            if bucket is self._buckets[-1]:
                # fill_ takes the value as a kernel argument; item assignment copies it from pageable host memory,
                # which makes the CPU wait for the device
                bucket.flat[-1:].fill_(1.0 if ctx.notice > ctx.generation else 0.0)
        # alone in the world the bucket already holds the sum (and the notice its agreement): a collective
        # would only make synchronize() wait for the device, ending the overlap of launches and kernels
        bucket.work = ring.allreduce_async(bucket.flat, Sum) if size > 1 else None

    # ---- step ------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every bucket's allreduce and write the results into `.grad`; the next `step()` uses them."""
        ctx = current()
        ctx.ensure_joined()
        try:
            if self._error is not None:
                raise self._error
            if ctx.generation != self._generation:
                self._reset_buckets()
                self._generation = ctx.generation
            for bucket in self._buckets[self._next_launch :]:
                self._launch(bucket)  # buckets with parameters that got no gradient this step
            for bucket in self._buckets:
                if bucket.work is not None:
                    waiting = time.perf_counter()
                    bucket.work.wait()
                    PACE.waited(time.perf_counter() - waiting)
                if bucket is self._buckets[-1]:
                    _agree(ctx, bucket.flat[-1:])
                offset = 0
                with torch.no_grad():
                    for p in bucket.params:
                        n = p.numel()
                        view = bucket.flat[offset : offset + n].view_as(p)
                        if p.is_contiguous():
                            p.grad = view  # the averaged gradient, in the bucket: no copy back
                        elif p.grad is None:
                            p.grad = view.clone()  # keeps autograd's layout for a non-contiguous parameter
                        else:
                            p.grad.copy_(view)
                        offset += n
        except HorovodInternalError:
            raise
        except RuntimeError as e:
            raise HorovodInternalError(f"gradient allreduce failed: {e}") from e
        finally:
            self._error = None
            self._reset_buckets()
        PACE.reduced(ctx.generation)
        self._synchronized = True

    def step(self, closure: Any = None, grad_scaler: torch.amp.GradScaler | None = None) -> Any:
        """Average the gradients across workers (unless `synchronize()` did), then step the wrapped optimizer.

        With a `GradScaler` (which passes itself): the scaled gradients are
        reduced, unscaled unless `scaler.unscale_(opt)` ran after
        `synchronize()`, and the step is skipped when any is inf or NaN.
        """
        scaler_state = grad_scaler._per_optimizer_states[id(self)] if grad_scaler is not None else None
        if scaler_state is not None and not self._synchronized and scaler_state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "scaler.unscale_(optimizer) ran before optimizer.synchronize(): the gradients it saw were not "
                "reduced yet, so nothing was unscaled (nor clipped). Call optimizer.synchronize() first, then "
                "scaler.unscale_(optimizer), clip, and scaler.step(optimizer)"
            )
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        if grad_scaler is None:
            return self.optimizer.step(closure)
        assert scaler_state is not None
        # what GradScaler does for a plain optimizer, on the reduced gradients (its own bookkeeping)
        if scaler_state["stage"] is OptState.READY:
            grad_scaler.unscale_(self)
        if sum(v.item() for v in scaler_state["found_inf_per_device"].values()):
            return None
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, buckets={len(self._buckets)})"
