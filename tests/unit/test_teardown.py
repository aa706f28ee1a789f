"""The run's one teardown (`teardown.remove_run`), with Ray's calls stood in for: no cluster.

Both `fit()`'s clean-up and a worker that finds its driver dead for good
call it; what a user would notice is a run left behind (an actor, a
placement group, an autoscaler share or a snapshot), so every step must run
even when another fails, and the worker, which dies with its placement
group, must have removed what needs no actor before.
"""

from __future__ import annotations

import logging

import pytest

from ray_elastic import teardown


@pytest.fixture
def steps(monkeypatch):
    done: list[tuple[str, str]] = []

    def step(name, fail=False):
        def call(arg):
            done.append((name, arg))
            if fail:
                raise RuntimeError(f"{name} failed")

        return call

    def install(failing=()):
        monkeypatch.setattr(teardown.snapshot, "delete", step("snapshot", "snapshot" in failing))
        monkeypatch.setattr(teardown.autoscale, "withdraw", step("autoscale", "autoscale" in failing))
        monkeypatch.setattr(teardown, "remove_run_placement_groups", step("groups", "groups" in failing))
        monkeypatch.setattr(teardown, "remove_run_actors", step("actors", "actors" in failing))
        return done

    return install


def test_what_needs_no_actor_goes_first_and_the_snapshot_goes_again_last(steps):
    """A worker dies with its placement group; a driver killed just before may still write its snapshot."""
    done = steps()
    teardown.remove_run("run1", "ray_elastic_run1", "fit()")
    assert done == [
        ("snapshot", "run1"),
        ("autoscale", "run1"),
        ("groups", "ray_elastic_run1"),
        ("actors", "ray_elastic_run1"),
        ("snapshot", "run1"),
    ]


def test_a_failing_step_is_logged_and_the_others_still_run(steps, caplog):
    done = steps(failing=("snapshot", "groups"))
    with caplog.at_level(logging.ERROR, logger="ray_elastic.teardown"):
        teardown.remove_run("run1", "ray_elastic_run1", "worker w3")
    assert [name for name, _ in done] == ["snapshot", "autoscale", "groups", "actors", "snapshot"]
    logged = [r for r in caplog.records if r.name == "ray_elastic.teardown"]
    assert len(logged) == 3 and all("worker w3: removing run run1" in r.getMessage() for r in logged)
