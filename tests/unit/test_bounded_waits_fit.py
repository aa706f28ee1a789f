"""fit()'s own waits end in bounded time, naming what they waited for (invariants 6 and 9; no cluster).

The driver's status and the checkpoint directory's storage; see docs/internals.md.
"""

from __future__ import annotations

import time

import pytest
import ray


def _hangs(*args, **kwargs):
    time.sleep(3)


class _Remote:
    def remote(self, *args):
        return "a reference"


def test_storage_that_hangs_ends_fits_check_of_checkpoint_dir_naming_it_and_the_option(tmp_path, monkeypatch):
    from ray_elastic import ElasticTrainer
    from ray_elastic.checkpoint import CheckpointStore
    from ray_elastic.trainer.preflight import check_checkpoint_dir

    monkeypatch.setattr(CheckpointStore, "check_writable", _hangs)
    trainer = ElasticTrainer(
        lambda config: None, min_workers=1, max_workers=1, checkpoint_dir=str(tmp_path), discovery_timeout=0.2
    )
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"checking '.*' \(discovery_timeout\) did not finish within 0.2 s"):
        check_checkpoint_dir(trainer.run_config, trainer.verbose)
    assert time.monotonic() - started < 2


class _Progress:
    def update(self, values) -> None:
        raise AssertionError("a silent driver gave no status")


def test_fit_gives_up_on_a_driver_that_answers_nothing_for_elastic_timeout_naming_it(monkeypatch, caplog):
    from ray_elastic.trainer.driver_watch import Reports, poll_driver

    began = time.monotonic()

    def status_times_out(ref, timeout=None):
        time.sleep(0.02)
        if time.monotonic() - began > 5:
            raise AssertionError("fit() waited on a silent driver without end")
        raise ray.exceptions.GetTimeoutError("Get timed out: some object(s) not ready.")

    class Driver:
        status = _Remote()

    monkeypatch.setattr(ray, "wait", lambda refs, timeout=None: ([], refs))
    monkeypatch.setattr(ray, "get", status_times_out)
    outcome = poll_driver(Driver(), "the run's reference", _Progress(), Reports(None), elastic_timeout=0.3)
    assert not outcome.ok
    assert "driver actor answered no status query" in outcome.error and "elastic_timeout=0.3 s" in outcome.error
    assert "has answered no status query" in caplog.text  # said while it waited, not only at the end
