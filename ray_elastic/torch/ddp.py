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

The gradients are reduced by DDP's C++ reducer, averaged as DDP averages
them. On Gloo, DDP is built over `_AbandonableGroup`, a process group of
ours around the ring's, whose allreduces the driver's abandon ends: without
it, a rank whose ring neighbours survived a death would wait in the reducer
until Gloo's `collective_timeout` (300 s). On NCCL, DDP runs on the ring's
process group as it is (NCCL has its own watchdog).
On Gloo, when every rank of the generation runs on one machine, our group
sums the buckets through shared memory instead of Gloo's TCP loopback
(`ray_elastic.collective.shm`, several times faster per sum; `bench/throughput.py`
compares the step with Ray Train's).
`gradient_as_bucket_view` defaults to True (each `.grad` is a view into
DDP's bucket: DDP scales each gradient into its bucket and copies nothing
back, one pass over the gradients per step where DDP's default makes two);
pass False for DDP's default. Around it:

- host-change agreement: on Gloo, a one-number allreduce of this rank's
  host-change notice starts right behind the first allreduce of a
  training forward's backward, and the `check_host_updates()` after the
  step reads it; when no reduction followed the forward, the check runs its
  own one-number collective, on every rank alike. On NCCL, a training
  forward (gradients on, not in `no_sync()`) starts one asynchronous
  one-number allreduce of the notice, which runs while forward and backward
  compute; the check after the step queues its copy to pinned host memory
  and the next check reads it (a commit's at once), so no step waits for
  the GPU (`ray_elastic.torch.notice`);
- failures: on Gloo a failed or abandoned allreduce leaves `backward()` as
  `HorovodInternalError`; on NCCL DDP raises it as a plain `RuntimeError`.
  `prepare_model` registers with the worker's runtime what such an error
  looks like (a `torch.distributed` error, or Gloo's), so the run loop
  (`@elastic.run`) rolls back and resets instead of failing the run as for
  a bug in `train_fn`; errors of DDP's collectives in forward are raised as
  `HorovodInternalError` at once.

Call the prepared model alike on every rank (DDP's buffer broadcast needs
that too); to evaluate on one rank, call `prepared.module`.

Works on the backends whose rings are torch.distributed process groups
(torch Gloo, NCCL). `backend="pygloo"` has no process group: `ElasticTrainer`
refuses a `train_fn` that calls `prepare_model` with it before any worker
starts (it reads the names `train_fn`'s code refers to), and
`prepare_model` itself refuses it in a worker, for a call the trainer
could not see.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ray_elastic.collective.activity import collective_activity
from ray_elastic.collective.factory import TORCH_BACKENDS
from ray_elastic.collective.shm import can_reduce
from ray_elastic.collective.torch_dist import TorchDistGroup
from ray_elastic.exceptions import HorovodInternalError
from ray_elastic.runtime.pace import PACE
from ray_elastic.runtime.process import current
from ray_elastic.torch.device import get_device
from ray_elastic.torch.notice import NoticeCopy
from ray_elastic.torch.sharded import wrap

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ray_elastic.runtime.context import WorkerContext
    from ray_elastic.runtime.generation import Generation

AGREE_EVERY_S = 0.1  # how often, in training time, the ranks agree on a host change (see _Cadence)
MAX_CHECKS_PER_AGREEMENT = 1000
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
        object.__setattr__(self, "_carrier", None)  # the last training forward's notice (see _carry_notice)
        object.__setattr__(self, "_cadence", _Cadence())  # which training forwards carry it

    @property
    def ddp(self) -> DistributedDataParallel:
        """The DDP of the current generation (built now if this generation has none yet)."""
        worker = current()  # a user's call (`no_sync()`, `.ddp`): the process's runtime
        return self._ddp_of(worker, worker.joined())

    def _ddp_of(self, worker: WorkerContext, generation: Generation) -> DistributedDataParallel:
        """`generation`'s DDP, built on the first call in it (the old generation's dropped)."""
        if self._ddp is None or self._generation != generation.number:
            self._drop()
            object.__setattr__(self, "_ddp", self._build(worker, generation))
            object.__setattr__(self, "_generation", generation.number)
        return self._ddp

    def _drop(self) -> None:
        """Forget the old generation's DDP, and its reducer now.

        A DDP is part of a reference cycle, so it outlives its last reference
        until the garbage collector runs; its reducer's hooks on the
        parameters would meanwhile act on the next DDP's gradients (after a
        forward that no backward followed, DDP fails the next one's step with
        "not the expected DDP bucket view"). The C++ reducer, held by the DDP
        and its logger only, removes its hooks when freed.
        """
        old = self._ddp
        object.__setattr__(self, "_ddp", None)
        if old is not None:
            old.reducer = None
            old.logger = None

    def _build(self, worker: WorkerContext, generation: Generation) -> DistributedDataParallel:
        # TorchState's sync already broadcast rank 0's parameters in this generation: skip DDP's second copy
        synced = worker.synced_generation == generation.number
        kwargs = dict(self._ddp_kwargs)
        ring = generation.ring
        try:
            if getattr(ring, "abortable", False):
                settle = bool(kwargs.get("static_graph"))
                kwargs["process_group"] = _AbandonableGroup(ring, self, settle=settle, generation=generation.number)
            return DistributedDataParallel(self.module, init_sync=not synced, **kwargs)
        except Exception as e:
            raise _as_ring_error(e, worker, "building DistributedDataParallel") from e

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # called by the user's loop, which has no runtime to hand over: the process's, found once per step
        worker = current()
        generation = worker.joined()
        ddp = self._ddp_of(worker, generation)
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            if not getattr(generation.ring, "abortable", False):
                self._agree_on_notice(worker, generation)
            elif self._cadence.due(generation.number):
                self._carry_notice(worker, generation)
            else:
                self._skip_notice(worker)
        try:
            return ddp(*args, **kwargs)
        except HorovodInternalError:
            raise
        except Exception as e:
            raise _as_ring_error(e, worker, "DistributedDataParallel's forward") from e

    def _carry_notice(self, worker: WorkerContext, generation: Generation) -> None:
        """Have the ring reduce this forward's host-change notice behind its backward's first allreduce (Gloo).

        `check_host_updates()` after the step reads the reduced notice; if no
        reduction followed this forward (no backward, or none that reduced),
        it runs its own one-number collective, on every rank alike. Until
        then the worker counts as inside a collective, so the driver's
        stuck-rank check does not take a rank waiting in DDP's reducer for one
        stuck in user code.
        """
        cadence = self._cadence
        carrier = _NoticeCarrier(int(worker.notice > generation.number), cadence.proposal())
        object.__setattr__(self, "_carrier", carrier)
        self._ddp.process_group.new_backward()  # forward built this generation's DDP, over our group
        collective_activity(True)

        def resolve() -> bool:
            try:
                ring = _ring(generation)
                if carrier.work is None:
                    cadence.agreed(0, 1)
                    return ring.max_int(worker.notice) > generation.number
                notices, proposals = carrier.reduced(ring)  # started during backward: done by now
                cadence.agreed(proposals, ring.size)
                return notices > 0
            finally:
                collective_activity(False)

        worker.agree_on_notice_later(resolve)

    def _skip_notice(self, worker: WorkerContext) -> None:
        """A training forward whose check agrees on nothing: the ranks agreed a moment ago, and will again soon.

        Every rank skips the same checks (the cadence is decided in the
        agreements), so the `check_host_updates()` after this step returns at
        once on every rank, and a host change is acted on at the next agreement.
        """
        object.__setattr__(self, "_carrier", None)
        self._ddp.process_group.new_backward()
        collective_activity(True)
        cadence = self._cadence

        def resolve() -> bool:
            collective_activity(False)
            cadence.skipped()
            return False

        worker.agree_on_notice_later(resolve)

    def _agree_on_notice(self, worker: WorkerContext, generation: Generation) -> None:
        """Start the one-number allreduce that tells every rank whether any holds a host-change notice (NCCL).

        It runs while forward and backward compute; the `check_host_updates()`
        after the step queues its copy to pinned host memory behind it, and the
        next check reads it (`Membership.agree_on_notice_deferred`): no check
        waits for the GPU, nor runs a collective itself. Until the step's
        check, the worker counts as inside a collective (the driver's
        stuck-rank check), as for a Gloo notice.
        """
        group = _ring(generation)
        mine = int(worker.notice > generation.number)
        if group.size == 1:
            worker.agree_on_notice(mine > 0)  # nobody to agree with: no collective, nothing to read off the GPU
            return
        # a fresh tensor each time (an earlier one may still be in flight if no check came between two forwards),
        # filled by a kernel: torch.tensor([...], device=gpu) would wait for the GPU to take the host's bytes
        notice = torch.full((1,), mine, dtype=torch.int64, device=group.device)
        work = group.start("check_host_updates", lambda: dist.all_reduce(notice, op=dist.ReduceOp.MAX, async_op=True))
        collective_activity(True)

        def start() -> Any:
            try:
                work.get_future().wait()  # NCCL: the current stream waits for the allreduce, the CPU does not
                return NoticeCopy(notice, lambda: group.wait_work("check_host_updates", work)).any
            finally:
                collective_activity(False)

        worker.agree_on_notice_deferred(start)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first one after it reduces them all."""
        with self.ddp.no_sync():
            yield


class _Cadence:
    """Which checks agree on the host-change notice (Gloo): about every `AGREE_EVERY_S` of training.

    An agreement is one more meeting of all the ranks, and on a small model
    the step is short enough for it to count (a small model on a few cores
    spends a noticeable share of a step's CPU on it). So each agreement
    also settles how many checks come before the next one: every rank
    proposes how many of its checks fit in `AGREE_EVERY_S` (from the time
    between its last two checks), the proposals are summed with the
    notices, and each rank skips the same `sum // world - 1` checks
    (those return at once, agreeing on nothing). Checks further apart than
    `AGREE_EVERY_S` (a slow step, or `check_host_updates()` called only at
    commits) all agree, as before; so does the first check of every
    generation. Skipped checks are the same on every rank because every rank
    runs the same training forwards and checks (DDP needs that anyway).
    """

    __slots__ = ("generation", "skip", "last_check", "interval")

    def __init__(self) -> None:
        self.generation = -1
        self.skip = 0  # checks left before the next agreement
        self.last_check: float | None = None
        self.interval: float | None = None  # seconds between this rank's last two checks

    def due(self, generation: int) -> bool:
        """Whether a training forward of `generation` carries the notice (the first of a generation does)."""
        if generation != self.generation:
            self.generation, self.skip, self.last_check, self.interval = generation, 0, None, None
        return self.skip <= 0

    def proposal(self) -> int:
        """How many checks this rank would like per agreement: as many as fit in `AGREE_EVERY_S`."""
        if not self.interval:
            return 1
        return max(1, min(MAX_CHECKS_PER_AGREEMENT, int(AGREE_EVERY_S / self.interval)))

    def agreed(self, proposals: int, world: int) -> None:
        self._checked()
        self.skip = proposals // world - 1

    def skipped(self) -> None:
        self._checked()
        self.skip -= 1

    def _checked(self) -> None:
        now = time.perf_counter()
        if self.last_check is not None:
            self.interval = now - self.last_check
        self.last_check = now


class _NoticeCarrier:
    """One training forward's host-change notice and cadence proposal, reduced behind its backward's first bucket."""

    __slots__ = ("tensor", "work")

    def __init__(self, notice: int, proposal: int) -> None:
        self.tensor = torch.tensor([notice, proposal], dtype=torch.int64)
        self.work: Any = None  # their allreduce (a Gloo work), once started

    def reduced(self, group: Any) -> tuple[int, int]:
        """The notices and the proposals summed over the ranks: waits for the allreduce, abandonably (raises the
        ring's error)."""
        group.wait_work("check_host_updates", self.work)
        notices, proposals = self.tensor.numpy()  # host memory: read without a tensor call
        return int(notices), int(proposals)


class _AbandonableGroup(dist.ProcessGroup):
    """The ring's Gloo process group as one generation's DDP sees it: a backward leaves at the driver's abandon.

    DDP's C++ reducer, without a communication hook, reduces each bucket with
    this group's `allreduce` and waits on the returned work's future in its
    finalization, a final callback it queues on autograd's engine when the
    last bucket is ready. Gloo's own future ends only with the operation, or
    at Gloo's `collective_timeout` (300 s): a rank whose ring neighbours
    survived a death (they leave the ring without closing their links to it)
    would wait there that long. So the first allreduce of a backward queues a
    final callback of ours, which runs before the reducer's: it waits for
    the backward's allreduces abandonably (`TorchDistGroup.wait_work`, left
    at once when the driver abandons the generation) and raises the ring's
    error from `backward()`. After a failure the reducer's finalization never
    runs (and the generation's DDP is dropped), which matters twice: it
    would wait on Gloo's future without end, and torch 2.13's reducer crashes
    the process (SIGSEGV in `parseCppCommHookResult`) on a failed future.
    The reducer therefore gets Gloo's own work, and nothing of ours runs on
    Gloo's thread when it ends: a Python callback there must take the GIL
    from the training thread, and such callbacks make Gloo's thread use
    markedly more CPU than under plain DDP. One exception
    (`settle`): with `static_graph`, the first backward of each DDP reduces
    every bucket from a final callback and finalizes in the same call, before
    ours can run; for that backward the reducer gets a future that never
    fails and ends at the abandon (`TorchDistGroup.abandonable_future`).
    Broadcasts (DDP's sync of buffers in forward) wait abandonably too.
    Anything else DDP calls (the parameter-shape check's allgather when it is
    built) goes to the Gloo group as it is.

    Being a process group and not a communication hook keeps DDP's own
    averaging: it multiplies by 1/world inside its copy of each fresh
    gradient into the bucket, and with `gradient_as_bucket_view` nothing is
    copied back, so a step makes one pass over the gradients besides the
    allreduce (a hook gets the bucket unscaled and has to scale it in a
    second pass; Ray Train's DDP scales in its copy and copies back out).

    Where the generation's ranks share one machine (`shared_ring()`), a
    sum of one bucket runs through shared memory, in the reducer's call,
    before it returns: the reducer gets a finished future, and a failure
    (a peer gone, the abandon) is raised by our final callback as for Gloo.

    Right behind the first allreduce after a training forward (the first
    bucket's, or with `find_unused_parameters` the used-parameter map's), a
    one-number allreduce of that forward's host-change notice starts,
    queued on the same Gloo thread, so the check after the step finds it done.
    """

    def __init__(self, group: Any, owner: Any, settle: bool = False, generation: int = 0) -> None:
        inner = dist.distributed_c10d._get_default_group()
        super().__init__(inner.rank(), inner.size())
        self._group = group
        self._generation = generation  # the generation whose ring this is, for the pace meter (0: outside a worker)
        self._inner = inner
        self._owner = owner
        self._settle = settle  # hand the reducer futures of ours (a static graph's first backward: see above)
        self._pending: list[dist.Work] = []  # this backward's allreduces, until its final callback
        # the ranks share one machine: gradient sums go through shared memory instead of Gloo (see shm.py)
        self._shared = group.shared_ring() if hasattr(group, "shared_ring") else None
        # a shared-memory sum failed: a peer is gone and this backward raises, so no notice allreduce starts on
        # the Gloo ring any more (one started as a peer died could outlive the ring's cut: 8 s to the next step)
        self._shared_failed = False

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        # not "gloo": for a known name DDP's logger asks this group for that backend's object, which it lacks
        return "ray_elastic_gloo"

    def new_backward(self) -> None:
        """A training forward ran: the next allreduce is its backward's first (an earlier backward may have
        raised before its final callback ran)."""
        self._pending = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = dist.AllreduceOptions() if opts is None else opts
        what = "DDP's gradient allreduce"
        if not self._pending:  # the backward's first allreduce: this rank's compute of the step ends
            PACE.launched(self._generation)
        if self._shared is not None and can_reduce(tensors, opts.reduceOp == dist.ReduceOp.SUM):
            work = self._reduce_shared(tensors)
        elif self._settle:
            ring = self._group.abandonable_future(what, lambda: self._inner.allreduce(tensors, opts), lambda: tensors)
            settled: torch.futures.Future = torch.futures.Future()
            ring.add_done_callback(lambda _: settled.set_result(tensors))
            work = _FutureWork(ring, settled)
        else:
            work = self._group.start(what, lambda: self._inner.allreduce(tensors, opts))
        if not self._pending:
            with contextlib.suppress(RuntimeError):  # called outside a backward (DDP's join): wait() raises
                torch.autograd.Variable._execution_engine.queue_callback(self._raise_if_failed)
        self._pending.append(work)
        carrier = self._owner._carrier
        if carrier is not None and carrier.work is None and not self._shared_failed:
            carrier.work = self._group.start(
                "check_host_updates", lambda: self._inner.allreduce([carrier.tensor], dist.AllreduceOptions())
            )
        return work

    def _reduce_shared(self, tensors: list[torch.Tensor]) -> dist.Work:
        """Sum the bucket through shared memory now; a failure is raised by `_raise_if_failed`, not to the reducer."""
        assert self._shared is not None  # chosen only where the node's ranks share memory
        reduced: torch.futures.Future = torch.futures.Future()
        reduced.set_result(tensors)  # what the reducer waits on never fails (torch 2.13 crashes on that)
        ring = reduced
        waiting = time.perf_counter()
        try:
            self._shared.allreduce_sum_(tensors[0])
        except HorovodInternalError as e:
            self._shared_failed = True
            ring = torch.futures.Future()
            ring.set_exception(e)
        PACE.waited(time.perf_counter() - waiting)  # the sum waits for every rank's bucket: that is the wait
        return _FutureWork(ring, reduced)

    def _raise_if_failed(self) -> None:
        """Autograd's final callback: wait for this backward's allreduces; the ring's error leaves `backward()`."""
        pending, self._pending = self._pending, []
        waiting = time.perf_counter()
        for work in pending:
            if isinstance(work, _FutureWork):
                work.wait()  # raises HorovodInternalError: the ring failed, or the driver abandoned it
            else:
                self._group.wait_work("DDP's gradient allreduce", work)  # idem
        PACE.waited(time.perf_counter() - waiting)
        PACE.reduced(self._generation)
        self._settle = False  # a static graph's first backward is over: the reducer finalizes after us from now on

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = dist.BroadcastOptions() if opts is None else opts
        ring = self._group.abandonable_future(
            "DDP's broadcast", lambda: self._inner.broadcast(tensors, opts), lambda: tensors
        )
        return _FutureWork(ring, ring)  # waited on in forward, in the caller's thread: wait() raises there

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self._inner.allgather(outputs, inputs, dist.AllgatherOptions() if opts is None else opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._inner.barrier(dist.BarrierOptions() if opts is None else opts)


class _FutureWork(dist.Work):
    """A torch `Work` over one of our futures: `wait()` raises the ring's error.

    `get_future()` is what DDP's reducer waits on: for an allreduce of a
    static graph's first backward a future that never fails (see
    `_AbandonableGroup`); for a broadcast, waited on through `wait()` in
    forward, the ring's future itself.
    """

    def __init__(self, ring: torch.futures.Future, settled: torch.futures.Future) -> None:
        super().__init__()
        self._ring = ring
        self._settled = settled

    def wait(self, timeout: Any = None) -> bool:
        self._ring.wait()  # raises HorovodInternalError when the ring failed or was abandoned
        return True

    def is_completed(self) -> bool:
        return self._ring.done()

    def get_future(self) -> torch.futures.Future:
        return self._settled


def is_ring_error(e: BaseException) -> bool:
    """Whether `e` came from torch.distributed's own machinery failing: a `DistError`, or Gloo's `RuntimeError`."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and "gloo" in str(e).lower()  # Gloo's errors name its source files


def _ring(generation: Generation) -> TorchDistGroup:
    """The generation's ring, as `prepare_model` has it: a torch process group (it refuses other backends)."""
    group = generation.ring
    assert isinstance(group, TorchDistGroup), f"prepare_model runs on torch's backends, not on {group!r}"
    return group


def _as_ring_error(e: BaseException, worker: WorkerContext, what: str) -> BaseException:
    """`e` as a `HorovodInternalError` if the ring is broken or `e` came from it, else `e` itself."""
    if isinstance(e, HorovodInternalError) or worker.ring_failure(e) is None:
        return e
    return HorovodInternalError(f"{what} failed: {e}")


def prepare_model(
    model: torch.nn.Module,
    *,
    move_to_device: bool = True,
    parallel_strategy: str = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
    **ddp_kwargs: Any,
) -> torch.nn.Module:
    """Move `model` to this worker's device and wrap it in DistributedDataParallel over the elastic ring.

    `parallel_strategy="fsdp"` shards it with FSDP2 instead (`fully_shard` on
    each block, then on the root, over the ring's one-dimensional mesh; see
    `ray_elastic.torch.sharded.wrap` for the policy and docs/sharded-models.md):
    `parallel_strategy_kwargs` takes `mp_policy`, `reshard_after_forward` and
    `offload_policy`, and the model returned is the same module, sharded.

    Call it in `train_fn`, where Ray Train users call
    `ray.train.torch.prepare_model`. As there, the model is first moved to
    `get_device()` (the worker's GPU when Ray gave it one, else the CPU;
    `move_to_device=False` leaves it where it is); build the optimizer
    after it, as after `model.cuda()`. Every other keyword goes to
    `DistributedDataParallel` (`find_unused_parameters`, `bucket_cap_mb`,
    `static_graph`, `broadcast_buffers` ...), except `process_group`,
    `device_mesh` and `init_sync`, which the ring decides;
    `gradient_as_bucket_view` defaults to True (each `.grad` a view into
    DDP's bucket: clone one you keep past the next step). Put the returned
    module in `TorchState(model=...)`; use a plain torch optimizer (not
    `DistributedOptimizer`: DDP already averages the gradients).

    Raises:
        ValueError: under `backend="pygloo"`, or for an option the ring sets.
        TypeError: `model` is not a `torch.nn.Module`, or is already wrapped.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model wraps a torch.nn.Module, got {type(model).__name__}")
    if parallel_strategy not in ("ddp", "fsdp"):
        raise ValueError(f"prepare_model(parallel_strategy={parallel_strategy!r}): 'ddp' or 'fsdp'")
    if parallel_strategy == "fsdp":
        return wrap.prepare(model, move_to_device, parallel_strategy_kwargs or {}, ddp_kwargs)
    if parallel_strategy_kwargs:
        ddp_kwargs = {**parallel_strategy_kwargs, **ddp_kwargs}
    if isinstance(model, (ElasticDDP, DistributedDataParallel)):
        raise TypeError(f"prepare_model got a model already wrapped in {type(model).__name__}: pass the plain module")
    own = [k for k in _OWN_OPTIONS if k in ddp_kwargs]
    if own:
        raise ValueError(f"prepare_model sets {', '.join(own)} itself (the elastic ring's process group)")
    ctx = current()
    ctx.add_ring_error_check(is_ring_error)
    if ctx.backend not in TORCH_BACKENDS:
        raise ValueError(
            f"prepare_model wraps the model in torch DistributedDataParallel, which needs a torch.distributed "
            f"process group, but this run uses backend={ctx.backend!r}: pass backend='gloo' (CPU) or "
            "'nccl' (GPU) to ElasticTrainer, or leave backend='auto'"
        )
    if move_to_device:
        model.to(get_device())
    return ElasticDDP(model, {"gradient_as_bucket_view": True, **ddp_kwargs})
