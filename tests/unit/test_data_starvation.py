"""A Ray Data pipeline starved of CPUs fails the run in bounded time; a slow one does not (no Ray needed)."""

from __future__ import annotations

import pytest

from ray_elastic.data.starvation import Probe, Starvation
from ray_elastic.exceptions import DataStarvedError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def watch(
    free: list[float], data_cpus: int = 0, timeout: float = 60.0, waiting: list[float] | None = None, running=None
) -> tuple[Starvation, Clock]:
    """A starvation clock whose probe reads `free` CPUs, `waiting` CPUs asked by pending tasks (1 by default)
    and the job's `running` tasks (none by default)."""
    clock = Clock()
    waiting = [1.0] if waiting is None else waiting
    running = [0] if running is None else running
    return Starvation(timeout, data_cpus, probe=lambda: Probe(free[0], waiting[0], running[0]), clock=clock), clock


def wait(starvation: Starvation, clock: Clock, seconds: float, since: float, produced_at: float = 0.0) -> None:
    """A rank's wait as the feed does it: a check after every second of waiting."""
    for _ in range(int(seconds)):
        clock.t += 1.0
        starvation.check("train", since, produced_at)


def test_no_block_for_the_timeout_while_no_cpu_is_free_fails_naming_the_cause_and_the_option():
    starvation, clock = watch(free=[0.0])
    wait(starvation, clock, 59, since=clock.t)
    with pytest.raises(DataStarvedError) as e:
        wait(starvation, clock, 1, since=100.0)
    message = str(e.value)
    assert "no block of dataset 'train' for 60 s while the cluster had no free CPU, tasks waited" in message
    assert "data_cpus=0" in message and "data_starvation_timeout" in message


def test_a_block_produced_or_a_free_cpu_restarts_the_count():
    starvation, clock = watch(free=[0.0])
    wait(starvation, clock, 50, since=clock.t)
    wait(starvation, clock, 50, since=100.0, produced_at=clock.t)  # a block came 50 s into the wait
    free = [2.0]
    slow, clock = watch(free=free, data_cpus=1)  # a slow pipeline on a cluster with CPUs to spare never fails
    wait(slow, clock, 300, since=clock.t)
    free[0] = 0.0
    wait(slow, clock, 59, since=100.0)  # the CPUs were taken a moment ago: 59 s, not 359
    with pytest.raises(DataStarvedError, match="data_cpus=1"):
        wait(slow, clock, 1, since=100.0)


def test_a_pipeline_busy_on_its_own_cpu_is_slow_not_starved():
    """data_cpus=1 left one CPU, which the pipeline's own long task keeps busy while its next tasks queue."""
    running = [1]
    slow, clock = watch(free=[0.0], data_cpus=1, running=running)
    wait(slow, clock, 300, since=clock.t)  # one block taking 5 minutes: never a DataStarvedError
    running[0] = None  # the state API stopped answering: no free CPU and a task waiting decide
    wait(slow, clock, 59, since=100.0)
    with pytest.raises(DataStarvedError, match="data_cpus=1"):
        wait(slow, clock, 1, since=100.0)


def test_a_block_produced_while_the_probe_asks_the_cluster_reaches_the_waiting_rank():
    """The probe can take seconds (Ray's state API under load): the producer must not wait for it to hand a block."""
    import threading
    import time
    from types import SimpleNamespace

    from ray_elastic.data.feed import _Epoch

    probing = threading.Event()
    seen_while_probing: list[bool] = []

    class OneBlockAfterTheProbeStarts:
        def iter_internal_ref_bundles(self):
            assert probing.wait(30), "the rank never probed"
            entry = SimpleNamespace(ref="block-0", metadata=SimpleNamespace(size_bytes=8, num_rows=4))
            yield SimpleNamespace(blocks=[entry], slices=[None])

    def probe() -> Probe:
        probing.set()
        deadline = time.monotonic() + 10
        while not epoch.refs and time.monotonic() < deadline:  # the producer appends the block under the feed's lock
            time.sleep(0.01)
        seen_while_probing.append(bool(epoch.refs))
        return Probe(free_cpus=0.0, waiting_cpus=1.0, running_tasks=1)

    epoch = _Epoch("train", OneBlockAfterTheProbeStarts(), ahead=4, budget=1e9, starvation=Starvation(60, 1, probe))
    entries, ended = epoch.blocks(0, wait_s=30)
    assert entries == [(("block-0", 0), 4)]
    assert seen_while_probing == [True], "the block waited for the probe to end: the probe held the feed's lock"
