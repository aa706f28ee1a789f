"""Unit tests for `ray_elastic.state`: `ObjectState` save/restore and reset callbacks.

No Ray cluster: `sync()` needs one and is covered by the integration tests.
`commit()` is checked against a stand-in worker context.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_elastic.exceptions import HostsUpdatedInterrupt
from ray_elastic.runtime import process as runtime
from ray_elastic.state import ObjectState, State

# ---- save / restore ------------------------------------------------------------------


def test_restore_without_save_returns_to_the_constructor_values():
    state = ObjectState(epoch=0, batch=0, history=[])
    state.epoch = 3
    state.batch = 17
    state.history.append(1.5)
    state.restore()
    assert (state.epoch, state.batch, state.history) == (0, 0, [])


def test_restore_returns_to_the_last_save_not_an_earlier_one():
    state = ObjectState(epoch=0, batch=0)
    state.epoch, state.batch = 1, 10
    state.save()
    state.epoch, state.batch = 2, 20
    state.save()
    state.epoch, state.batch = 3, 99  # a step after the last commit, lost on failure
    state.restore()
    assert (state.epoch, state.batch) == (2, 20)


def test_in_place_mutation_after_save_does_not_change_the_saved_copy():
    weights = np.arange(4, dtype=np.float64)
    state = ObjectState(weights=weights, meta={"lr": 0.1, "seen": [1, 2]})
    state.save()
    state.weights += 100.0  # in-place, like an optimizer step
    state.meta["lr"] = 0.5
    state.meta["seen"].append(3)
    state.restore()
    np.testing.assert_array_equal(state.weights, np.arange(4, dtype=np.float64))
    assert state.meta == {"lr": 0.1, "seen": [1, 2]}


def test_mutating_a_restored_value_does_not_affect_the_saved_copy():
    state = ObjectState(weights=np.zeros(3), log=["start"])
    state.restore()
    state.weights[0] = 7.0
    state.log.append("step")
    state.restore()  # a second failure before any new commit rolls back to the same point
    np.testing.assert_array_equal(state.weights, np.zeros(3))
    assert state.log == ["start"]


def test_save_copies_the_value_the_caller_passed_in():
    shared = [1, 2, 3]
    state = ObjectState(items=shared)
    shared.append(4)  # the caller keeps using its own list
    state.restore()
    assert state.items == [1, 2, 3]


def test_restore_brings_back_a_rebound_attribute():
    state = ObjectState(model={"w": 1})
    state.model = None
    state.restore()
    assert state.model == {"w": 1}


@given(
    st.lists(
        st.tuples(st.integers(), st.lists(st.integers(), max_size=5), st.booleans()),
        min_size=1,
        max_size=10,
    )
)
def test_restore_always_returns_to_the_most_recent_save(steps):
    state = ObjectState(counter=0, buf=[])
    expected = (0, [])
    for counter, buf, commit in steps:
        state.counter = counter
        state.buf.extend(buf)
        if commit:
            state.save()
            expected = (counter, list(state.buf))
    state.restore()
    assert (state.counter, state.buf) == expected


# ---- reset callbacks -----------------------------------------------------------------


def test_on_reset_calls_callbacks_in_registration_order_every_reset():
    calls: list[str] = []
    state = ObjectState(epoch=0)
    state.register_reset_callbacks([lambda: calls.append("lr"), lambda: calls.append("sampler")])
    state.register_reset_callbacks([lambda: calls.append("log")])
    state.on_reset()
    assert calls == ["lr", "sampler", "log"]
    state.on_reset()
    assert calls == ["lr", "sampler", "log"] * 2


def test_on_reset_without_callbacks_does_nothing():
    state = ObjectState(epoch=5)
    state.on_reset()
    assert state.epoch == 5


def test_register_reset_callbacks_accepts_any_iterable():
    calls: list[int] = []
    state = ObjectState()
    state.register_reset_callbacks(lambda i=i: calls.append(i) for i in range(3))
    state.on_reset()
    assert calls == [0, 1, 2]


@pytest.mark.parametrize("bad", [[42], [print, "not callable"], [None]])
def test_register_reset_callbacks_rejects_non_callables_and_registers_none_of_them(bad):
    calls: list[str] = []
    state = ObjectState()
    state.register_reset_callbacks([lambda: calls.append("ok")])
    with pytest.raises(TypeError, match="callable"):
        state.register_reset_callbacks(bad)
    state.on_reset()
    assert calls == ["ok"]


def test_register_reset_callbacks_rejects_a_bare_function():
    # Horovod's API takes a list; a bare function is a common slip that must not pass silently
    state = ObjectState()
    with pytest.raises(TypeError):
        state.register_reset_callbacks(lambda: None)


# ---- commit / check_host_updates -------------------------------------------------------


class FakeContext:
    """Stands in for the worker context: raises the interrupt when told hosts changed."""

    def __init__(self, hosts_changed: bool) -> None:
        self.hosts_changed = hosts_changed
        self.checks = 0
        self.commits: list[float] = []

    def after_commit(self, state: object, save_seconds: float) -> None:
        self.commits.append(save_seconds)

    def check_host_updates(self) -> None:
        self.checks += 1
        if self.hosts_changed:
            raise HostsUpdatedInterrupt()


def test_commit_saves_before_checking_host_updates(monkeypatch):
    ctx = FakeContext(hosts_changed=True)
    monkeypatch.setattr(runtime, "_current", ctx)
    state = ObjectState(batch=0)
    state.batch = 41
    with pytest.raises(HostsUpdatedInterrupt):
        state.commit()
    assert ctx.checks == 1
    state.batch = 42
    state.restore()
    assert state.batch == 41  # the interrupted commit still saved its step


def test_commit_without_host_changes_just_saves(monkeypatch):
    ctx = FakeContext(hosts_changed=False)
    monkeypatch.setattr(runtime, "_current", ctx)
    state = ObjectState(batch=0)
    state.batch = 5
    state.commit()
    state.batch = 6
    state.restore()
    assert state.batch == 5
    assert ctx.checks == 1
    assert len(ctx.commits) == 1 and ctx.commits[0] >= 0, "the commit's cost is recorded (metrics, checkpoints)"


def test_check_host_updates_outside_a_worker_says_where_it_works(monkeypatch):
    monkeypatch.setattr(runtime, "_current", None)
    with pytest.raises(RuntimeError, match="ElasticTrainer.fit"):
        ObjectState(epoch=0).check_host_updates()


def test_base_state_leaves_save_restore_sync_to_subclasses():
    state = State()
    for method in (state.save, state.restore, state.sync):
        with pytest.raises(NotImplementedError):
            method()
