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
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ray_elastic.assignment import WorkerSlot
from ray_elastic.collective.base import guarded_call
from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.config import WorkerConfig
from ray_elastic.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ray_elastic.torch import DistributedOptimizer
from ray_elastic.torch import state as torch_state
from ray_elastic.worker_context import WorkerContext, current, set_current


class FakeDriver:
    """Records what a worker sends the driver (each `.remote` call)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, method: str) -> Any:
        driver = self

        class Method:
            def remote(self, *args: Any) -> None:
                driver.calls.append((method, args))

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


def test_a_notice_is_agreed_inside_the_last_gradient_bucket(world_of_one, monkeypatch):
    model = torch.nn.Linear(4, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    world_of_one.notify(2)  # the driver announced generation 2
    model(torch.ones(2, 4)).sum().backward()
    opt.step()

    def no_collective(value: int) -> int:
        raise AssertionError("check_host_updates() after a step ran a collective of its own")

    monkeypatch.setattr(world_of_one.group, "max_int", no_collective)
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
    torch_state.OptimizerHandler(opt).receive(rank0)  # what a receiving rank does with rank 0's description
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
    world_of_one.in_collective = True  # what tests/workloads.py's stuck_in_collective fault does
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
    while not shipped and time.monotonic() < deadline:
        time.sleep(0.05)
    # numbered batches: a driver restarted between a send and its answer takes a batch sent again once
    assert [(name, wid, [m for _, m in batch], seq) for name, (wid, batch, seq) in shipped] == [
        ("add_metrics", "w0", [{"loss": 0.5}, {"loss": 0.25}], 1)
    ]
