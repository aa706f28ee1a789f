"""The worker runtime's parts in one process, without Ray.

A real `WorkerContext` is made this process's runtime, with a torch Gloo ring
of one rank over an in-memory store standing in for a joined generation. It
checks what `DistributedOptimizer` asks of the runtime and of the collective
interface (buckets on the parameters' device, refusal of pygloo, a step, the
host-change agreement carried by the last bucket), the activity marks every
blocking collective leaves, and the metrics shipper.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ray_elastic.assignment import WorkerSlot
from ray_elastic.collective.base import guarded_call
from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ray_elastic.protocol import WorkerConfig
from ray_elastic.runtime.context import WorkerContext
from ray_elastic.runtime.process import current, set_current
from ray_elastic.torch import DistributedOptimizer, ElasticSampler
from ray_elastic.torch import state as torch_state
from ray_elastic.torch.optimizer_handler import OptimizerHandler


class FakeDriver:
    """Records what a worker sends the driver (each `.remote` call)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, method: str) -> Any:
        driver = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> None:
                # a keyword (add_metrics' paces=, runtime/pace.py) is recorded as a last argument
                driver.calls.append((method, (*args, kwargs) if kwargs else args))

        return Method()


def make_context(backend: str = "gloo", rank: int = 0, driver: FakeDriver | None = None) -> WorkerContext:
    ctx = WorkerContext("w0", kv=None, driver=driver or FakeDriver(), settings=WorkerConfig(backend=backend))
    set_current(ctx)
    return ctx


@pytest.fixture
def world_of_one() -> Iterator[WorkerContext]:
    """This process joined to generation 1 as rank 0 of 1, on a real Gloo ring."""
    ctx = make_context()
    ctx.membership.group = TorchGlooGroup(dist.HashStore(), 0, 1, 30.0)
    ctx.membership.slot = WorkerSlot("w0", "host", 0, 1, 0, 1, 0, 1)
    ctx.membership.generation = 1
    try:
        yield ctx
    finally:
        set_current(None)
        ctx.shutdown()


@pytest.fixture(autouse=True)
def no_ray(monkeypatch) -> None:
    """FakeDriver's calls return no ObjectRef: the metrics shipper's `ray.get` must not start a local Ray.

    Without this, a shipped batch made Ray's auto-init start a whole local
    cluster from the shipper's thread, which a later test's cluster fixture
    then met as "ray.init twice".
    """
    from ray_elastic.runtime import metrics_shipper

    monkeypatch.setattr(metrics_shipper.ray, "get", lambda ref, timeout=None: ref)


@pytest.fixture
def no_runtime() -> Iterator[None]:
    yield
    set_current(None)


# ---- DistributedOptimizer on the runtime --------------------------------------------


@pytest.mark.parametrize(
    ("device", "dtype"), [("meta", torch.float32), ("cpu", torch.float64), ("cpu", torch.bfloat16)]
)
def test_gradient_buckets_live_on_the_parameters_device_with_their_dtype(device, dtype):
    # "meta" stands in for a GPU on this CPU-only machine: a bucket elsewhere than its parameters
    # fails the first step (`torch.mul(..., out=bucket)`, `p.grad = bucket_view`); test_gpu.py runs it on CUDA
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)).to(device=device, dtype=dtype)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=1e-5)  # one per tensor
    assert len(opt._buckets) == 4
    for bucket in opt._buckets:
        assert (bucket.flat.device.type, bucket.flat.dtype) == (device, dtype)


def test_parameters_on_two_devices_never_share_a_bucket():
    cpu, meta = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3, device="meta")
    opt = DistributedOptimizer(torch.optim.SGD([*cpu.parameters(), *meta.parameters()], lr=0.1))
    for bucket in opt._buckets:
        assert {p.device for p in bucket.params} == {bucket.flat.device}


def test_the_pygloo_backend_is_refused_when_the_optimizer_is_built(no_runtime):
    ctx = make_context(backend="pygloo")
    try:
        model = torch.nn.Linear(3, 1)
        with pytest.raises(ValueError, match="backend='pygloo'.*backend='gloo'"):
            DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        ctx.shutdown()


def test_a_step_in_a_world_of_one_applies_the_local_gradient(world_of_one):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
    twin.load_state_dict(model.state_dict())
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=0.0001)
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    for _ in range(3):
        for m, o in ((model, opt), (twin, plain)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_failure_is_told_to_the_driver_before_the_state_restores_and_only_once(world_of_one, monkeypatch):
    """The driver plans the next generation while the ranks restore (22-34 ms at 300M + Adam), not after."""
    import ray_elastic as elastic
    from ray_elastic.state.state import State
    from ray_elastic.wire import ResetRequested

    driver = world_of_one.membership.driver
    told_at_restore: list[list[ResetRequested]] = []

    def resets() -> list[ResetRequested]:
        return [args[0] for name, args in driver.calls if name == "tell" and isinstance(args[0], ResetRequested)]

    class Recorded(State):
        def save(self) -> None:
            pass

        def restore(self) -> None:
            told_at_restore.append(resets())

        def sync(self) -> None:
            pass

    def join() -> None:  # the next generation, without a driver: a fresh ring of one
        world_of_one.membership.group = TorchGlooGroup(dist.HashStore(), 0, 1, 30.0)
        world_of_one.membership.generation += 1

    monkeypatch.setattr(world_of_one.membership, "_join", join)
    failures = iter([HorovodInternalError("the ring broke"), RuntimeError("a torch error"), None])
    monkeypatch.setattr(world_of_one.membership, "ring_failure", lambda e: "abandoned")

    @elastic.run
    def train(state: State) -> str:
        failure = next(failures)
        if failure is not None:
            raise failure
        return "done"

    assert train(Recorded()) == "done"
    assert [len(told) for told in told_at_restore] == [1, 2]
    assert [r.generation for r in resets()] == [1, 2], "once per failed generation, by reset() no more"


def test_a_notice_is_agreed_inside_the_last_gradient_bucket(world_of_one, monkeypatch):
    model = torch.nn.Linear(4, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    world_of_one.notify(2)  # the driver announced generation 2
    model(torch.ones(2, 4)).sum().backward()
    opt.step()

    def no_collective(value: int) -> int:
        raise AssertionError("check_host_updates() after a step ran a collective of its own")

    monkeypatch.setattr(world_of_one.joined().ring, "max_int", no_collective)
    with pytest.raises(HostsUpdatedInterrupt):
        world_of_one.check_host_updates()


def test_a_newcomers_optimizer_state_is_created_on_its_parameters_device():
    """Rank 0 has momentum, the newcomer none yet: taking rank 0's description creates it by the parameter."""
    model = torch.nn.Linear(3, 2, device="meta")  # "meta" stands in for a GPU
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rank0 = {
        "tensors": [(0, "momentum_buffer", (2, 3), torch.float32)],
        "values": {},
        "hyper": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }
    OptimizerHandler(opt).receive(rank0)  # what a receiving rank does with rank 0's description
    assert opt.state[model.weight]["momentum_buffer"].device == model.weight.device


# ---- activity marks --------------------------------------------------------------------


def test_a_blocking_collective_marks_the_worker_inside_it_and_leaves_a_fresh_mark(world_of_one):
    before = world_of_one.last_activity
    seen: list[bool] = []
    time.sleep(0.01)
    guarded_call("probe", lambda: seen.append(current().in_collective))
    assert seen == [True]
    assert not world_of_one.in_collective
    assert world_of_one.last_activity > before


def test_a_broken_ring_is_a_horovod_internal_error_naming_the_collective_and_the_mark_is_cleared(world_of_one):
    def broken() -> None:
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(HorovodInternalError, match="gradient allreduce failed: Connection closed"):
        guarded_call("gradient allreduce", broken)
    assert not world_of_one.in_collective


def test_a_test_can_mark_a_worker_stuck_in_a_collective(world_of_one):
    world_of_one.in_collective = True  # what tests/support/workloads.py's stuck_in_collective fault does
    assert world_of_one.activity.in_collective


# ---- metrics ------------------------------------------------------------------------------


def test_rank_0s_reports_reach_the_driver_in_the_background_and_others_are_not_kept(world_of_one):
    driver = FakeDriver()
    other = make_context(driver=driver)
    other.membership.slot = WorkerSlot("w1", "host", 1, 2, 0, 1, 0, 1)
    other.report({"loss": 1.0})
    other.shutdown()
    assert driver.calls == []

    set_current(world_of_one)
    world_of_one.report({"loss": 0.5})
    world_of_one.report({"loss": 0.25})
    deadline = time.monotonic() + 5
    shipped = world_of_one.metrics.driver.calls
    while not world_of_one.metrics.delivered() and time.monotonic() < deadline:
        time.sleep(0.05)
    # delivered() (what a test waits on before killing rank 0) says the driver has them
    # numbered batches: a driver restarted between a send and its answer takes a batch sent again once
    assert [(name, wid, [m for _, m in batch], seq) for name, (wid, batch, seq) in shipped] == [
        ("add_metrics", "w0", [{"loss": 0.5}, {"loss": 0.25}], 1)
    ]


class FakeLastingKV:
    """The KV's keys of no generation, in memory."""

    def __init__(self) -> None:
        self.lasting: dict[str, bytes] = {}

    def post_lasting(self, key: str, value: bytes) -> None:
        self.lasting[key] = value

    def get_lasting(self, key: str, timeout: float = 10.0) -> bytes | None:
        return self.lasting.get(key)


def adam_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def test_a_newcomer_faults_in_rank0s_optimizer_layout_while_waiting_and_receives_into_it(world_of_one, monkeypatch):
    """Rank 0 publishes its Adam moments' layout at a commit; a newcomer allocates them before its sync."""
    import itertools

    kv = FakeLastingKV()
    world_of_one.membership.kv = kv
    monkeypatch.setattr(torch_state, "_state_numbers", itertools.count())
    model, opt = adam_model()
    state = torch_state.TorchState(model=model, optimizer=opt)
    assert kv.lasting == {}, "no optimizer state yet: nothing to publish"
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    state.save()
    assert len(kv.lasting) == 1, "rank 0 publishes its layout at a commit"
    published = dict(kv.lasting)
    state.save()
    assert kv.lasting == published and len(kv.lasting) == 1
    rank0 = state._handlers["optimizer"]
    description = rank0.describe()

    # a newcomer in another process: no ring yet, the same code builds the same state
    newcomer = make_context()
    newcomer.membership.kv = kv
    monkeypatch.setattr(torch_state, "_state_numbers", itertools.count())
    model2, opt2 = adam_model()
    state2 = torch_state.TorchState(model=model2, optimizer=opt2)
    newcomer.membership.run_join_preparations()  # what _join does before it waits to be admitted
    handler = state2._handlers["optimizer"]
    assert opt2.state == {}, "preparing must leave the optimizer as it was"
    prepared = {k: t.data_ptr() for k, t in handler._prepared.items()}
    want = {(i, key) for i, key, _, _ in description["tensors"]}
    assert set(prepared) == want, "every moment of rank 0's commit is allocated ahead"
    handler.receive(description)
    params = handler._params()
    got = {(i, key): opt2.state[params[i]][key].data_ptr() for i, key in want}
    assert got == prepared, "the sync receives into the tensors prepared while waiting"
    buffers = [b.data_ptr() for b in handler._buffers.buffers]
    assert len(buffers) == len(want), "the commit's buffers are allocated ahead too"
    assert not set(buffers) & set(prepared.values())
    for sent, into in zip(rank0.tensors(), handler.tensors(), strict=True):
        into.copy_(sent)  # what the transfer does
    handler.received()  # the newcomer's commit of what it received
    handler._buffers.wait()
    assert [b.data_ptr() for b in handler._buffers.buffers] == buffers, "the commit goes into the buffers made ahead"
    for (i, key), b in zip(handler._layout, handler._buffers.buffers, strict=True):
        assert torch.equal(b, opt2.state[params[i]][key])
    handler.after_sync()
    assert handler._prepared == {}
    newcomer.shutdown()


@pytest.mark.parametrize("wrapped", [False, True], ids=["adam", "distributed adam"])
def test_a_newcomer_warms_the_heap_for_the_gradients_its_first_backward_holds_at_once(
    world_of_one, monkeypatch, wrapped
):
    """Every gradient with a plain optimizer; with DistributedOptimizer only its largest bucket's, not all.

    The warmed blocks stay resident in the newcomer: warming every gradient
    behind a DistributedOptimizer cost a third of a copy of the state (model +
    Adam) for nothing, since its buckets free autograd's gradients in backward.
    """
    import itertools

    kv = FakeLastingKV()
    world_of_one.membership.kv = kv
    warmed: list[int] = []
    monkeypatch.setattr(torch_state, "warm_heap", lambda like: warmed.append(sum(t.numel() for t in like)) or 0)

    def build() -> tuple[torch.nn.Module, Any]:
        model, adam = adam_model()
        return model, DistributedOptimizer(adam, bucket_cap_mb=0.02) if wrapped else adam

    monkeypatch.setattr(torch_state, "_state_numbers", itertools.count())
    model, opt = build()
    state = torch_state.TorchState(model=model, optimizer=opt)
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    state.save()  # rank 0 publishes its optimizer's layout

    newcomer = make_context()
    newcomer.membership.kv = kv
    monkeypatch.setattr(torch_state, "_state_numbers", itertools.count())
    model2, opt2 = build()
    torch_state.TorchState(model=model2, optimizer=opt2)
    newcomer.membership.run_join_preparations()
    newcomer.shutdown()
    every = sum(p.numel() for p in model2.parameters())
    if wrapped:
        assert len(opt2._buckets) > 1
        largest = max(sum(p.numel() for p in b.params) for b in opt2._buckets)
        assert warmed == [largest] and largest < every
    else:
        assert warmed == [every]


def test_a_newcomer_collects_its_boots_garbage_before_joining_not_during_the_sync_everyone_waits_on(no_runtime):
    """Python's full collection over a fresh worker's objects took 0.15 s of a 100M newcomer's 0.57 s sync."""
    import gc
    import weakref

    class Node:
        pass

    def cycle() -> weakref.ref:
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    newcomer = make_context()
    gc.collect()
    was_enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.set_threshold(10**9)  # the collector's own schedule must not free the cycle before the preparations do
    gc.disable()
    try:
        garbage = cycle()
        assert garbage() is not None, "a reference cycle outlives its last name until a collection"
        newcomer.membership.run_join_preparations()  # what _join does before it tells the driver it is ready
        assert garbage() is not None, "with the collector off (a user's choice), joining leaves it off"
        gc.enable()
        garbage = cycle()
        newcomer.membership.run_join_preparations()  # preparations run once; the collection on each call
        assert garbage() is None, "the boot's garbage is collected before joining"
    finally:
        gc.set_threshold(*thresholds)
        (gc.enable if was_enabled else gc.disable)()
        newcomer.shutdown()


def test_building_a_torch_state_inside_a_ring_runs_no_collective_and_a_later_save_does(world_of_one):
    """A Horovod script's newcomer builds its state already in the ring, while the survivors are in their sync.

    A collective in the constructor's commit (the sampler's union agreement)
    met the survivors' sync agreement instead, and the run hung.
    """
    ring = world_of_one.membership.group
    calls = []
    max_int = ring.max_int

    def counting(value: int) -> int:
        calls.append(value)
        return max_int(value)

    ring.max_int = counting
    dataset = list(range(32))
    sampler = ElasticSampler(dataset, shuffle=False)
    model, opt = adam_model()
    state = torch_state.TorchState(model=model, optimizer=opt, sampler=sampler)
    assert calls == [], "the constructor's commit ran a collective"
    state.save()
    assert len(calls) == 1, "a later commit agrees on the sampler's union"
