"""The wire between the run's actors and the driver: every fact one class, told through one typed method.

No Ray: the classes, the core's union and handlers, and the senders in the
source are read as they are.
"""

from __future__ import annotations

import asyncio
import pathlib
import re
import typing

import pytest

from ray_elastic import wire
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.driver_core import _HANDLERS

TOLD = set(typing.get_args(wire.ToldMessage))
SOURCE = pathlib.Path(wire.__file__).parent


def test_every_told_fact_is_a_message_of_the_core_with_a_handler():
    every = set(typing.get_args(m.Message))
    assert TOLD <= every, f"told but not in the core's Message union: {TOLD - every}"
    assert set(_HANDLERS) == every, f"messages without a handler: {every - set(_HANDLERS)}"
    assert all(issubclass(t, wire.Fact) for t in every), "every message declares its traits"
    assert {t for t in every if issubclass(t, wire.Told)} == TOLD, "a Told class left out of ToldMessage"


def test_every_told_fact_has_a_sender_through_tell():
    """A fact nobody sends is dead code in the core; one sent any other way bypasses the typed handle."""
    sent: set[str] = set()
    for path in SOURCE.rglob("*.py"):
        text = path.read_text()
        sent.update(re.findall(r"\.tell\.remote\(\s*(\w+)\(", text))
    names = {t.__name__ for t in TOLD}
    assert names - sent == set(), f"told facts no actor sends through DriverActor.tell: {names - sent}"


def test_the_driver_refuses_what_is_not_a_told_fact():
    from ray_elastic.driver_actor import DriverActor

    actor = DriverActor.__new__(DriverActor)
    with pytest.raises(TypeError, match="DriverActor.tell takes a ray_elastic.wire message, got Tick"):
        asyncio.run(actor.tell(m.Tick()))  # a shell-side message: a worker cannot make the core believe it


def test_traits_are_the_classes_own():
    assert not m.Tick.changes_plan and m.Tick.quiet
    assert not wire.DataSlow.changes_plan and not wire.DataSlow.quiet
    assert m.WorkerDied.changes_plan and not m.WorkerDied.quiet
