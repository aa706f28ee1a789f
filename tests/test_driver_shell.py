"""The driver shell's pure helpers, without Ray: how it builds its discovery and reads its calls' outcomes.

The shell (`driver/actor.py`) turns what Ray hands it into the core's
messages; these tests hold the parts of that translation a user would
notice: a restarted driver that fails a run on one discovery hiccup, or an
error read as a death that never comes.
"""

from __future__ import annotations

from ray_elastic.config import RunConfig
from ray_elastic.driver.actor import make_poller


def config(**overrides) -> RunConfig:
    values = {"min_workers": 1, "max_workers": 2, "resources_per_worker": {"CPU": 1.0}, "elastic_timeout": 60.0}
    values.update(overrides)
    return RunConfig(**values)


class Flaky:
    """A discovery callable whose service blinks."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        raise ConnectionError("the inventory service blinked")


def test_a_restarted_drivers_discovery_retries_a_transient_failure_within_elastic_timeout():
    """Issue 34: a restarted driver's first discovery hiccup failed the run instead of being retried."""
    source = Flaky()
    poller = make_poller(source, config(), resumed=True)
    assert poller.poll() is None, "the failure keeps the last view, as before the restart"
    assert source.calls == 1


def test_a_fresh_runs_first_discovery_failure_still_fails_at_once():
    poller = make_poller(Flaky(), config(), resumed=False)
    try:
        poller.poll()
    except Exception as e:  # noqa: BLE001 - DiscoveryError, checked by its text
        assert "the inventory service blinked" in str(e)
    else:
        raise AssertionError("a run whose discovery fails at its start must fail naming why")
