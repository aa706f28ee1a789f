"""A worker's boot marks (`runtime/boot_marks.py`): stamped once, split into phases in boot order."""

from __future__ import annotations

import pytest

from ray_elastic.protocol import WorkerConfig
from ray_elastic.runtime.boot_marks import ORDER, BootMarks, phases
from ray_elastic.runtime.context import WorkerContext


def test_a_point_is_stamped_the_first_time_only():
    marks = BootMarks()
    marks.mark("ready", at=5.0)
    marks.mark("ready", at=9.0)  # a later reset's join is no boot
    marks.mark("admitted")
    assert marks["ready"] == 5.0
    assert marks["admitted"] > 9.0


def test_phases_follow_the_boot_order_whatever_order_the_marks_came_in():
    marks = {point: float(i * i) for i, point in enumerate(ORDER)}
    shuffled = dict(reversed(list(marks.items())))
    got = phases(shuffled)
    assert [(p.start, p.end) for p in got] == list(zip(ORDER, ORDER[1:], strict=False))
    assert [p.seconds for p in got] == [float(2 * i + 1) for i in range(len(ORDER) - 1)]
    assert sum(p.seconds for p in got) == pytest.approx(marks["first_step"] - marks["offered"])
    assert got[0].label == "discovery poll"
    assert got[-1].label == "first step"


def test_a_missing_point_merges_its_two_phases_and_foreign_marks_are_left_out():
    marks = {"offered": 0.0, "actor_entered": 2.0, "actor_left": 2.5, "somebody_elses": 1.0}
    got = phases(marks)
    assert [(p.label, p.seconds) for p in got] == [
        ("discovery poll + placement group + process start", 2.0),
        ("actor constructor", 0.5),
    ]
    assert phases({"ready": 1.0}) == []


def test_the_join_stamps_the_contexts_own_marks():
    ctx = WorkerContext("w0", kv=None, driver=None, settings=WorkerConfig())
    try:
        ctx.membership.marks.mark("admitted", at=3.0)
        assert ctx.boot_marks == {"admitted": 3.0}
    finally:
        ctx.shutdown()
