"""Each rank's pace, as the driver's straggler policy receives it: compute and wait per step, per interval.

The meter runs on a scripted clock (pure), then under a real
`DistributedOptimizer` in a world of one (no Ray), and its summaries ride in
the metrics shipper's batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from test_worker_runtime import make_context

from ray_elastic.assignment import WorkerSlot
from ray_elastic.collective.torch_gloo import TorchGlooGroup
from ray_elastic.protocol import PaceSummary
from ray_elastic.runtime import metrics_shipper
from ray_elastic.runtime.pace import PaceMeter
from ray_elastic.runtime.process import set_current
from ray_elastic.torch import DistributedOptimizer, optimizer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scripted(interval_s: float = 1.0) -> tuple[PaceMeter, Clock, list[PaceSummary]]:
    clock = Clock()
    meter = PaceMeter(interval_s=interval_s, clock=clock, wall=clock)
    out: list[PaceSummary] = []
    meter.sink = out.append
    return meter, clock, out


def step(meter: PaceMeter, clock: Clock, compute: float, wait: float, generation: int = 1) -> None:
    clock.now += compute
    meter.launched(generation)
    clock.now += wait
    meter.waited(wait)
    meter.reduced(generation)


def test_compute_runs_from_the_end_of_one_steps_collectives_to_the_next_launch():
    meter, clock, out = scripted()
    step(meter, clock, 0.05, 0.01)  # the ring's first step: no end of collectives before it, not counted
    for _ in range(10):
        step(meter, clock, 0.08, 0.02)
    assert len(out) == 1
    s = out[0]
    assert s.steps == 10 and s.generation == 1
    assert abs(s.compute_per_step - 0.08) < 1e-9 and abs(s.wait_per_step - 0.02) < 1e-9
    assert abs((s.end - s.start) - (0.01 + 10 * 0.1)) < 1e-9  # from the ring's first launch


def test_a_reset_starts_afresh_and_the_old_rings_interval_is_dropped():
    meter, clock, out = scripted(interval_s=0.95)
    for _ in range(5):
        step(meter, clock, 0.1, 0.0)
    step(meter, clock, 0.1, 0.0, generation=2)  # the new ring's first step: not counted
    for _ in range(12):
        step(meter, clock, 0.1, 0.0, generation=2)
    assert [(s.generation, s.steps) for s in out] == [(2, 10)]


def test_a_second_launch_in_one_step_does_not_count_twice():
    meter, clock, out = scripted(interval_s=0.0)
    step(meter, clock, 0.1, 0.0)
    clock.now += 0.3
    meter.launched(1)
    clock.now += 0.2
    meter.launched(1)  # a later bucket
    meter.reduced(1)
    assert abs(out[-1].compute_s - 0.3) < 1e-9


def test_the_optimizer_marks_each_step_and_the_shipper_carries_the_summaries(monkeypatch):
    sent = []

    class Driver:
        class add_metrics:  # noqa: N801 - the driver's method name
            @staticmethod
            def remote(worker_id, batch, seq, **kw):
                sent.append((worker_id, batch, kw))

    monkeypatch.setattr(metrics_shipper.ray, "get", lambda ref, timeout=None: ref)
    ctx = make_context(driver=Driver())
    ctx.membership.group = TorchGlooGroup(dist.HashStore(), 0, 1, 30.0)
    ctx.membership.slot = WorkerSlot("w0", "host", 0, 1, 0, 1, 0, 1)
    ctx.membership.generation = 1
    meter = PaceMeter(interval_s=0.0)  # a fresh one: the process's meter keeps what earlier tests' steps left
    meter.sink = ctx.metrics.add_pace
    monkeypatch.setattr(optimizer, "PACE", meter)
    try:
        model = torch.nn.Linear(64, 1)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
        for _ in range(4):
            model(torch.randn(32, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        set_current(None)
        ctx.shutdown()
    paces = [p for _, _, kw in sent for p in kw.get("paces", [])]
    assert [p.steps for p in paces] == [1, 1, 1]  # the first step of the ring has no start
    assert all(p.compute_s > 0 and p.wait_s >= 0 and p.generation == 1 for p in paces)
    assert all(batch == [] for _, batch, _ in sent)  # no report made: the batch carries the paces alone


def test_the_frameworks_work_set_aside_is_not_compute_and_the_median_step_is_shipped():
    meter, clock, out = scripted(interval_s=1.0)
    step(meter, clock, 0.02, 0.0)
    for i in range(50):
        clock.now += 0.02  # the step's own compute
        if i % 10 == 0:
            with meter.aside():  # rank 0 blocked 1.3 s in the checkpoint writer
                clock.now += 1.3
        meter.launched(1)
        meter.reduced(1)
    s = out[0]
    assert abs(s.compute_per_step - 0.02) < 1e-9 and abs(s.typical_s - 0.02) < 1e-9
    assert s.aside_s > 1.2


def test_extra_user_work_every_n_steps_raises_the_mean_step_not_the_median():
    meter, clock, out = scripted(interval_s=1.0)
    step(meter, clock, 0.02, 0.0)
    for i in range(40):
        step(meter, clock, 0.02 + (0.3 if i % 10 == 0 else 0.0), 0.0)  # an evaluation every 10 steps
    s = out[0]
    assert s.compute_per_step > 0.03 and abs(s.typical_s - 0.02) < 1e-9 and s.aside_s == 0.0


def test_rank_0s_checkpoint_copy_and_its_wait_for_the_writer_are_set_aside(monkeypatch):
    """Rank 0 hands a commit to a writer whose previous write is still running: the wait is not its pace."""
    from ray_elastic.protocol import WorkerConfig
    from ray_elastic.runtime import checkpoint_cadence

    meter, clock, out = scripted(interval_s=1.0)
    monkeypatch.setattr(checkpoint_cadence, "PACE", meter)
    monkeypatch.setattr(checkpoint_cadence, "state_entries", lambda state: {})

    class SlowWriter:
        def submit(self, entries, meta, timeout):
            clock.now += 1.3  # the previous write (a slow store) still runs

    cadence = checkpoint_cadence.CheckpointCadence("w0", driver=None, settings=WorkerConfig(checkpoint_every=1))
    cadence._writer = SlowWriter()
    slot = WorkerSlot("w0", "host", 0, 4, 0, 1, 0, 4)
    step(meter, clock, 0.02, 0.0)
    for commits in range(1, 41):
        step(meter, clock, 0.02, 0.01)
        cadence.after_commit(None, slot, generation=1, commits=commits)
    assert out and all(abs(s.compute_per_step - 0.02) < 1e-9 for s in out)
