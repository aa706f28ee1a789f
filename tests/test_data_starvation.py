"""A Ray Data pipeline starved of CPUs fails the run in bounded time; a slow one does not (no Ray needed)."""

from __future__ import annotations

import pytest

from ray_elastic.data.starvation import Starvation
from ray_elastic.exceptions import DataStarvedError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def watch(free: list[float], data_cpus: int = 0, timeout: float = 60.0) -> tuple[Starvation, Clock]:
    clock = Clock()
    return Starvation(timeout, data_cpus, probe=lambda: free[0], clock=clock), clock


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
    assert "no block of dataset 'train' for 60 s while the cluster had no free CPU" in message
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
