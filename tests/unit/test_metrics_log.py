"""Long runs keep bounded memory: the driver holds only unfetched reports, fit() only the newest it keeps."""

from __future__ import annotations

from ray_elastic.driver.shell.metrics_log import MetricsLog
from ray_elastic.trainer.driver_watch import Reports


def reports(start: int, n: int) -> list[tuple[float, dict]]:
    return [(float(i), {"step": i}) for i in range(start, start + n)]


def test_fetching_hands_over_new_reports_and_releases_the_fetched_ones():
    log = MetricsLog("run")
    log.add(reports(0, 5))
    first, got = log.fetch(0)
    assert first == 0 and [m["step"] for _, m in got] == [0, 1, 2, 3, 4]
    log.add(reports(5, 3))
    first, got = log.fetch(5)  # the caller has 0..4: they are released
    assert first == 5 and [m["step"] for _, m in got] == [5, 6, 7]
    assert len(log) == 8 and len(log._entries) == 3


def test_a_caller_that_stops_fetching_bounds_the_driver_at_its_capacity():
    log = MetricsLog("run", capacity=100)
    for start in range(0, 10_000, 50):
        log.add(reports(start, 50))
    assert len(log._entries) == 100 and log.dropped == 9_900 and len(log) == 10_000
    first, got = log.fetch(0)
    assert first == 9_900 and got[0][1]["step"] == 9_900


def test_fit_keeps_the_newest_reports_counts_the_rest_and_never_takes_one_twice():
    kept = Reports(keep=4)
    assert [m["step"] for _, m in kept.take(0, reports(0, 3))] == [0, 1, 2]
    # the final outcome repeats what a last status already handed over: taken once
    assert [m["step"] for _, m in kept.take(1, reports(1, 6))] == [3, 4, 5, 6]
    assert [m["step"] for _, m in kept.kept] == [3, 4, 5, 6] and kept.dropped == 3 and kept.seen == 7
    # the driver dropped 7..9 unfetched: they count as dropped too
    kept.take(10, reports(10, 1))
    assert kept.seen == 11 and kept.dropped == 7


def test_keep_none_keeps_everything():
    kept = Reports(keep=None)
    kept.take(0, reports(0, 1000))
    assert len(kept.kept) == 1000 and kept.dropped == 0
