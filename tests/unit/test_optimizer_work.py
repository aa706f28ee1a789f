"""`DistributedOptimizer`'s per-step work, and GradScaler on it, in a world of two without a second process.

The ring is a mirror: its allreduce adds what an identical peer would (the
bucket itself, so an averaged gradient comes back whole and bit for bit),
and a test can have the peer send something else (an inf). The work is
counted as torch's dispatcher sees it (`TorchDispatchMode`: every operator
call, views and copies included), the optimizer's against a plain
optimizer's on the same model, for two models that differ only in their
number of parameters.
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch
from test_worker_runtime import make_context, no_ray  # noqa: F401 - fixtures
from torch.utils._python_dispatch import TorchDispatchMode

from ray_elastic.assignment import WorkerSlot
from ray_elastic.collective.base import CollectiveWork, ReduceOp
from ray_elastic.exceptions import HorovodInternalError
from ray_elastic.runtime.process import current, set_current
from ray_elastic.torch import DistributedOptimizer


class Mirror:
    """A ring of two whose other rank sends `peer(bucket)` (by default the same gradients: the bucket again)."""

    size = 2

    def __init__(self) -> None:
        self.peer: Callable[[torch.Tensor], torch.Tensor] = torch.clone
        self.reduced = 0

    def allreduce_async(self, value: torch.Tensor, op: ReduceOp) -> CollectiveWork:
        self.reduced += 1
        sent = self.peer(value)
        return CollectiveWork("allreduce", then=lambda: value.add_(sent))

    def close(self) -> None:
        """Nothing to let go: the peer is a function."""


def _world(size: int) -> Iterator[Mirror]:
    """This process as rank 0 of a joined world of `size` (1 or 2), its ring the mirror."""
    ctx = make_context()
    ring = Mirror()
    ctx.membership.group = ring
    ctx.membership.slot = WorkerSlot("w0", "host", 0, size, 0, size, 0, 1)
    ctx.membership.generation = 1
    try:
        yield ring
    finally:
        set_current(None)
        ctx.shutdown()


@pytest.fixture
def world_of_two() -> Iterator[Mirror]:
    yield from _world(2)


@pytest.fixture
def world_of_one() -> Iterator[Mirror]:
    yield from _world(1)


class Ops(TorchDispatchMode):
    """Counts the operator calls made inside it (tensor operators; not profiler records)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        if not str(func).startswith("profiler."):  # the step's own profiler record, as any optimizer's
            self.calls[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _model(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(layers)))


def _extra_ops(layers: int, set_to_none: bool) -> Counter[str]:
    """The operator calls of two steps (backward + step) with the optimizer, less those with a plain SGD."""
    counts = []
    for wrapped in (True, False):
        model = _model(layers)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = DistributedOptimizer(sgd, bucket_cap_mb=64) if wrapped else sgd
        x = torch.ones(2, 8)
        _ = [_step(model, opt, x, set_to_none) for _ in range(2)]  # the first steps make the buckets
        with Ops() as ops:
            _step(model, opt, x, set_to_none)
        counts.append(ops.calls)
    return counts[0] - counts[1]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, set_to_none: bool) -> None:
    opt.zero_grad(set_to_none=set_to_none)
    model(x).square().mean().backward()
    opt.step()


@pytest.mark.parametrize("set_to_none", [True, False], ids=["grads set to None", "grads zeroed"])
def test_a_steps_work_grows_with_the_buckets_not_with_the_parameters(world_of_two, set_to_none):
    few, many = _extra_ops(2, set_to_none), _extra_ops(16, set_to_none)  # 4 and 32 parameters, one bucket each
    assert few == many, f"work per parameter: {dict(many - few)} more operator calls for 28 more parameters"
    assert sum(many.values()) <= 12, f"a one-bucket step (the mirror's two included): {dict(many)}"
    if not set_to_none:
        assert "copy_" not in many and "_foreach_copy_" not in many, "gradients kept in the bucket were copied"


def test_alone_in_the_world_the_optimizer_adds_no_work_and_no_bucket(world_of_one):
    assert sum(_extra_ops(16, set_to_none=True).values()) == 0
    model = _model(3)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    _step(model, opt, torch.ones(2, 8), set_to_none=True)
    assert all(b._flat is None for b in opt._buckets), "a bucket (a second copy of the gradients) was made"
    assert world_of_one.reduced == 0


def test_a_world_that_grows_from_one_and_shrinks_back_is_followed(world_of_one):
    """After a reset to two, the gradients are averaged when backward returns; after one back to one, nothing
    is reduced. Every step equals a plain optimizer's on the average (the mirror's peer sends zeros: half of ours).
    """
    model, twin = _model(3), _model(3)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    world_of_one.peer = torch.zeros_like
    ctx = current()
    x = torch.ones(2, 8)

    def step(size: int) -> None:
        reduced = world_of_one.reduced
        for m, o in ((model, opt), (twin, plain)):
            o.zero_grad()
            m(x).square().mean().backward()
        assert (world_of_one.reduced > reduced) == (size == 2), f"world of {size}: reduced {world_of_one.reduced}"
        if size == 2:
            for q in twin.parameters():
                q.grad /= 2
        opt.step()
        plain.step()
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            assert torch.equal(a, b), f"world of {size}: not the plain optimizer's step on the average"

    for size, generation in ((1, 1), (1, 1), (2, 2), (2, 2), (1, 3)):
        ctx.membership.slot = WorkerSlot("w0", "host", 0, size, 0, size, 0, generation)
        ctx.membership.generation = generation
        step(size)


def _launch_order(joined_first: bool, from_one: bool) -> list[int]:
    """Which of three optimizers' buckets a rank of a world of two allreduces, in order, in its first step.

    `joined_first`: the optimizers are made after the rank joined (a survivor's); otherwise before (a
    newcomer's, made by the training function before `fit()` gave it a ring). `from_one`: the rank trained
    alone first, and the world grew to two.
    """
    ring = Mirror()
    launched: list[torch.Tensor] = []
    reduce = ring.allreduce_async
    ring.allreduce_async = lambda value, op: (launched.append(value), reduce(value, op))[1]  # type: ignore[method-assign]
    ctx = make_context()

    def join(size: int, generation: int) -> None:
        ctx.membership.group = ring
        ctx.membership.slot = WorkerSlot("w0", "host", 0, size, 0, size, 0, generation)
        ctx.membership.generation = generation

    try:
        if joined_first:
            join(1 if from_one else 2, 1)
        parts = _model(3)
        opts = [DistributedOptimizer(torch.optim.SGD(part.parameters(), lr=0.1)) for part in parts]
        x = torch.ones(2, 8)

        def step() -> None:
            for o in opts:
                o.zero_grad()
            sum(part(x).square().mean() for part in parts).backward()
            for o in opts:
                o.step()

        if from_one:
            join(1, 1)
            step()
            launched.clear()
            join(2, 2)
        elif not joined_first:
            join(2, 1)
        step()
        return [next(k for k, o in enumerate(opts) if any(b.flat is t for b in o._buckets)) for t in launched]
    finally:
        set_current(None)
        ctx.shutdown()


def test_every_rank_allreduces_several_optimizers_buckets_in_one_order_however_it_came_to_the_world():
    """A newcomer that made its optimizers before it joined, a survivor, and a rank whose world grew from one
    issue the same allreduces in the same order: the buckets are all the same size, so a rank reducing them
    in another order sums each with the wrong peer's bucket, and the ranks diverge without an error."""
    survivor = _launch_order(joined_first=True, from_one=False)
    assert sorted(survivor) == [0, 1, 2]
    assert _launch_order(joined_first=False, from_one=False) == survivor, "the newcomer's order"
    assert _launch_order(joined_first=True, from_one=True) == survivor, "after the world grew from one"


def test_the_gradients_are_reduced_when_backward_returns_into_the_bucket_and_autograds_are_freed(world_of_two):
    """As with DDP: `.grad` after `backward()` is the average, a view into the bucket; autograd's copy is gone."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    autograds: dict[str, weakref.ref] = {}
    for name, p in model.named_parameters():  # registered first: runs before the optimizer's hook
        p.register_post_accumulate_grad_hook(lambda p, name=name: autograds.__setitem__(name, weakref.ref(p.grad)))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=0.01)
    assert len(opt._buckets) > 1
    world_of_two.peer = torch.zeros_like  # the other rank's gradients are zeros: the average is half of ours
    x = torch.randn(8, 64)
    twin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    twin.load_state_dict(model.state_dict())
    twin(x).square().mean().backward()
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        alive = sorted(name for name, ref in autograds.items() if ref() is not None)
        assert alive == [], f"autograd's gradients still held after backward: {alive}"
        flats = [(b.flat.data_ptr(), b.flat.data_ptr() + b.flat.numel() * 4) for b in opt._buckets]
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            assert any(lo <= p.grad.data_ptr() < hi for lo, hi in flats)
            assert torch.equal(p.grad, q.grad / 2), "not the average when backward returned"
        opt.step()
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        twin(x).square().mean().backward()


@pytest.mark.parametrize("clip", [False, True], ids=["scaler.step", "unscale_+clip after backward"])
def test_grad_scaler_steps_on_unscaled_reduced_gradients_and_every_rank_skips_the_peers_inf(world_of_two, clip):
    """Through GradScaler's current protocol: no `grad_scaler=` keyword (torch's FutureWarning is an error here).

    The other rank's gradients overflow at step 2 while ours are finite: our
    rank must skip that step and lower the scale, as a plain optimizer whose
    own gradients overflowed does; every other step equals the plain one bit
    for bit (an optimizer stepping on scaled gradients would not).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    twin.load_state_dict(model.state_dict())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    scalers = {id(o): torch.amp.GradScaler("cpu", init_scale=2.0**10) for o in (opt, plain)}
    stepped: list[bool] = []
    opt.optimizer.register_step_post_hook(lambda *_: stepped.append(True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for step in range(5):
            world_of_two.peer = (lambda b: torch.full_like(b, float("inf"))) if step == 2 else torch.clone
            for m, o in ((model, opt), (twin, plain)):
                scaler = scalers[id(o)]
                o.zero_grad()
                x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
                loss = m(x).pow(2).mean() * (float("inf") if step == 2 and o is plain else 1.0)
                scaler.scale(loss).backward()
                if clip:
                    scaler.unscale_(o)
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                scaler.step(o)
                scaler.update()
            assert scalers[id(opt)].get_scale() == scalers[id(plain)].get_scale(), f"scale at step {step}"
            for a, b in zip(model.parameters(), twin.parameters(), strict=True):
                assert torch.equal(a, b), f"step {step}"
    assert len(stepped) == 4, "the step whose reduced gradients overflowed was not skipped"
    assert scalers[id(opt)].get_scale() < 2.0**10


def test_accumulation_reduces_once_after_the_last_pass_and_a_transposed_parameter_keeps_its_layout(world_of_two):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 4).t())  # non-contiguous: its gradient keeps autograd's layout
    bias = torch.nn.Parameter(torch.randn(3))
    twin_w, twin_b = (torch.nn.Parameter(t.detach().clone()) for t in (weight, bias))
    opt = DistributedOptimizer(torch.optim.SGD([weight, bias], lr=0.1), backward_passes_per_step=2)
    plain = torch.optim.SGD([twin_w, twin_b], lr=0.1)
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for w, b, o in ((weight, bias, opt), (twin_w, twin_b, plain)):
        o.zero_grad()
        for i, x in enumerate(xs):
            (x @ w + b).square().mean().backward()
            if o is opt and i == 0:
                assert world_of_two.reduced == 0, "reduced after the first of two passes"
        o.step()
    assert world_of_two.reduced == len(opt._buckets)
    assert not weight.is_contiguous() and weight.grad.stride() == twin_w.grad.stride()
    assert torch.equal(weight, twin_w) and torch.equal(bias, twin_b)  # the mirror's average is our own sum


def test_a_broken_rings_error_recorded_by_every_optimizer_fails_only_its_own_generation(world_of_two):
    """Two optimizers over parts of one model: the ring breaks in one backward, both record it, the first one
    stepped raises, the loop resets to the next generation, and there the second one steps as any other."""
    torch.manual_seed(0)
    parts = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    opts = [DistributedOptimizer(torch.optim.SGD(p.parameters(), lr=0.1), p.named_parameters()) for p in parts]
    world_of_two.peer = lambda bucket: (_ for _ in ()).throw(RuntimeError("Connection reset by peer"))

    def backward() -> None:
        for o in opts:
            o.zero_grad()
        sum(p(torch.ones(1, 4)).sum() for p in parts).backward()

    backward()
    with pytest.raises(HorovodInternalError, match="Connection reset by peer"):
        opts[0].step()  # the run loop rolls back and resets here: opts[1] never steps in generation 1
    world_of_two.peer = torch.clone  # the next generation's ring is healthy
    current().membership.generation = 2
    backward()
    before = [p.weight.detach().clone() for p in parts]
    for o in opts:
        o.step()  # opts[1]'s error belonged to generation 1's ring: it must not fail generation 2
    assert all(not torch.equal(b, p.weight) for b, p in zip(before, parts, strict=True)), "both parts stepped"
