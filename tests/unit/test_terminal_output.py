"""Ray's raw dump of a dead worker is hidden only while `fit()` runs, and a user's own skip pattern stays.

integration/test_terminal_output_cluster.py shows the terminal of a real run whose worker dies.
"""

from __future__ import annotations

from ray_elastic.trainer.ray_output import WORKER_DEATH_DUMP


def test_the_dump_is_hidden_only_while_fit_runs_and_a_users_own_skip_pattern_stays(monkeypatch):
    """Ray's printing path in fit()'s process, fed as its error listener feeds it: what would reach the terminal."""
    import re

    from ray._private import ray_logging

    from ray_elastic.trainer.ray_output import worker_death_dumps_hidden

    dedup = ray_logging.stdout_deduplicator
    monkeypatch.setattr(dedup, "skip_re", re.compile("noisy line of the user's"))  # their RAY_DEDUP_LOGS_SKIP_REGEX
    dump = f"{WORKER_DEATH_DUMP}. To troubleshoot the problem, check the logs for the dead worker. Worker PID: 1"

    def printed(line: str) -> list[str]:
        batches = dedup.deduplicate({"lines": [line], "pid": "raylet", "is_err": False, "ip": "x", "job": ""})
        dedup.recent.clear()
        return [shown for batch in batches for shown in batch["lines"]]

    with worker_death_dumps_hidden():
        with worker_death_dumps_hidden():  # a second fit() at the same time, in another thread
            assert printed(dump) == [] and printed("a noisy line of the user's") == []
        assert printed(dump) == []  # the first fit() still runs
    assert printed(dump) == [dump]  # after fit(): Ray's own behaviour again
    assert printed("a noisy line of the user's") == []
