"""No step of the elastic loop waits for a device: the per-step path never reads a tensor on the host.

On a GPU, `.item()`, `.tolist()`, `.cpu()` and `torch.cuda.synchronize()`
each wait for everything queued on the device: called once per step, they
end the overlap of the CPU's kernel launches with the GPU's work (an H200
ran the DDP path at 0.75 of plain DDP's speed). Here, without a GPU, those
calls are counted while a CPU loop runs the library's per-step path (the
gradient reduction, `step()`, `check_host_updates()`) on a real one-rank
Gloo ring, on both the `DistributedOptimizer` and the `prepare_model` path.

The host-change agreement must still hold: with the device path forced on
CPU tensors (`reads_later`), a notice agreed in step k is acted on at the
check of step k+1 (a commit: at once), and the loop never misses it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ray_elastic.assignment import WorkerSlot
from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.exceptions import HostsUpdatedInterrupt
from ray_elastic.protocol import WorkerConfig
from ray_elastic.runtime.context import WorkerContext
from ray_elastic.runtime.process import set_current
from ray_elastic.state.state import ObjectState
from ray_elastic.torch import DistributedOptimizer, optimizer, prepare_model


class _Driver:
    def __getattr__(self, method: str):
        class Method:
            def remote(self, *args, **kwargs) -> None:
                pass

        return Method()


@pytest.fixture
def ring(monkeypatch) -> Iterator[WorkerContext]:
    """This process as rank 0 of 1 of generation 1, on a real Gloo ring."""
    from ray_elastic.runtime import metrics_shipper

    monkeypatch.setattr(metrics_shipper.ray, "get", lambda ref, timeout=None: ref)
    ctx = WorkerContext("w0", kv=None, driver=_Driver(), settings=WorkerConfig(backend="gloo"))
    set_current(ctx)
    ctx.membership.group = TorchGlooGroup(dist.HashStore(), 0, 1, 30.0)
    ctx.membership.slot = WorkerSlot("w0", "host", 0, 1, 0, 1, 0, 1)
    ctx.membership.generation = 1
    try:
        yield ctx
    finally:
        set_current(None)
        ctx.membership.close_group()
        ctx.shutdown()


@pytest.fixture
def host_reads(monkeypatch) -> Counter:
    """Counts every call that would wait for a device, by name, while the test runs."""
    counts: Counter = Counter()

    def counting(name, original):
        def call(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        return call

    for name in ("item", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", counting("synchronize", lambda *a, **k: None))
    return counts


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _as_world_of_two(ring: WorkerContext, monkeypatch) -> None:
    """The optimizer reduces in buckets as in a world of two (the ring of one hands each bucket back as it is)."""
    monkeypatch.setattr(ring.membership, "slot", WorkerSlot("w0", "host", 0, 2, 0, 2, 0, 1))


@pytest.mark.parametrize("size", [1, 2])
def test_the_distributed_optimizer_loop_reads_nothing_off_the_device(ring, host_reads, monkeypatch, size):
    if size == 2:
        _as_world_of_two(ring, monkeypatch)
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    for i in range(20):
        _step(model, opt, i)
        ring.check_host_updates()
    assert host_reads == Counter(), f"per-step host reads: {dict(host_reads)}"


def test_the_prepare_model_loop_reads_nothing_off_the_device(ring, host_reads):
    model = prepare_model(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    _step(model, opt, 0)  # the first forward builds DDP (its own set-up checks are not a step)
    ring.check_host_updates()
    host_reads.clear()
    for i in range(1, 20):
        _step(model, opt, i)
        ring.check_host_updates()
    assert host_reads == Counter(), f"per-step host reads: {dict(host_reads)}"


def test_a_notice_agreed_on_a_device_is_acted_on_at_the_next_check_or_at_once_at_a_commit(
    ring, host_reads, monkeypatch
):
    monkeypatch.setattr(optimizer, "reads_later", lambda t: True)  # CPU tensors take the GPU's path
    _as_world_of_two(ring, monkeypatch)  # alone, the optimizer agrees on the host at once: no bucket, no device
    model = _model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    for i in range(3):
        _step(model, opt, i)
        ring.check_host_updates()
    ring.notify(2)  # the driver announces generation 2 before step 3's allreduce
    _step(model, opt, 3)
    ring.check_host_updates()  # step 3's agreement is on its way to the host: not read yet
    _step(model, opt, 4)
    with pytest.raises(HostsUpdatedInterrupt):
        ring.check_host_updates()  # read now: every rank acts here, at step 4
    assert host_reads == Counter()

    # at a commit the agreement is read at once: the interrupt comes in the step that committed
    state = ObjectState(step=0)
    _step(model, opt, 5)
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()


def test_a_commit_keeps_its_copies_on_the_models_device(ring, monkeypatch):
    """A commit of a model and its optimizer keeps every copy where the tensors live ("meta" stands for a GPU):
    no silent copy through host memory."""
    from ray_elastic.torch import TorchState

    monkeypatch.setattr(ring.membership, "kv", type("KV", (), {"post_lasting": lambda self, key, value: None})())
    model = torch.nn.Linear(8, 4, device="meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
    state = TorchState(model=model, optimizer=opt, step=0)
    state.save()
    saved = [*state._handlers["model"]._saved.buffers, *state._handlers["optimizer"]._buffers.buffers]
    assert len(saved) == 4
    assert {t.device.type for t in saved} == {"meta"}


def test_ranks_told_at_different_steps_act_at_the_same_step():
    """Two ranks' runtimes, the notice reaching one at step 3 and the other at step 5: the agreement reduced in
    step 3 is read at step 4's check on both, so both raise there; no rank reads it at step 3."""
    from ray_elastic.runtime.membership import Membership

    ranks = [Membership(f"w{r}", kv=None, driver=None, settings=WorkerConfig()) for r in range(2)]
    for m in ranks:
        m.group, m.generation = object(), 1  # joined (no collective runs: every check has an agreement)
    told_at = {0: 3, 1: 5}
    raised_at: dict[int, int] = {}
    for step in range(1, 8):
        for r, m in enumerate(ranks):
            if step == told_at[r]:
                m.notify(2)
        reduced = max(int(m.notice > m.generation) for m in ranks)  # what the step's allreduce computes
        for r, m in enumerate(ranks):
            if r in raised_at:
                continue
            m.agree_on_notice_deferred(lambda reduced=reduced: lambda: reduced > 0)
            try:
                m.check_host_updates()
            except HostsUpdatedInterrupt:
                raised_at[r] = step
    assert raised_at == {0: 4, 1: 4}
