"""What a user watches, without Ray: event lines, the progress bar, the timeline plot."""

from __future__ import annotations

import logging

import pytest

from ray_elastic.events import Event
from ray_elastic.trainer.progress_bar import Progress, describe
from ray_elastic.trainer.timeline import plot_timeline, throughput, world_size_steps


def _event(kind: str, t: float, size: int, prev: int | None, duration: float | None, detail: str = "") -> Event:
    return Event(
        time=t,
        kind=kind,
        world_size=size,
        generation=1,
        reset_duration=duration,
        detail=detail,
        previous_world_size=prev,
    )


def test_event_lines_say_what_happened_how_long_it_took_and_the_sizes():
    died = _event("worker_failed", 0, 3, 4, 0.6, "worker w3 (rank 2) on node ab12cd34 died")
    assert describe(died.to_dict()) == (
        "[ray-elastic] worker w3 (rank 2) on node ab12cd34 died; recovered in 0.60 s, world size 4 -> 3"
    )
    added = _event("hosts_added", 0, 6, 4, 0.15, "2 new worker(s), admitted after booting 5.1 s")
    assert describe(added.to_dict()).endswith("; resized in 0.15 s, world size 4 -> 6")
    start = _event("start", 0, 4, 0, 7.0, "4 workers")
    assert describe(start.to_dict()) == "[ray-elastic] started with 4 workers in 7.0 s"
    # what paused no training is said as it happens, without a recovery it did not have
    slow = _event("data_slow", 0, 4, 4, 0.0, "block 3 of dataset 'train' took 61.0 s to produce")
    assert describe(slow.to_dict()) == "[ray-elastic] block 3 of dataset 'train' took 61.0 s to produce"


def test_progress_logs_each_completed_event_once_where_there_is_no_terminal(caplog):
    progress = Progress(enabled=True)  # pytest captures output: not a terminal, so no bar
    died = _event("worker_failed", 5, 3, 4, None, "worker w3 (rank 2) on node ab12cd34 died").to_dict()
    with caplog.at_level(logging.INFO, logger="ray_elastic"):
        progress.update({"state": "resetting", "events": [died], "metrics": [(1.0, {"step": 3})]})
        assert not caplog.records, "an event is logged once its recovery completed, with its duration"
        died["reset_duration"] = 0.08
        for _ in range(2):
            progress.update({"state": "running", "events": [died], "metrics": []})
    progress.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["[ray-elastic] worker w3 (rank 2) on node ab12cd34 died; recovered in 0.08 s, world size 4 -> 3"]


def test_verbose_0_shows_nothing(caplog, capsys):
    progress = Progress(enabled=False)
    died = _event("worker_failed", 5, 3, 4, 0.1, "worker died").to_dict()
    with caplog.at_level(logging.INFO, logger="ray_elastic"):
        progress.update({"state": "running", "events": [died], "metrics": [(1.0, {"step": 3})]})
    progress.close()
    assert not caplog.records
    assert capsys.readouterr() == ("", "")


def test_world_size_series_follows_the_events():
    events = [
        _event("start", 100, 4, 0, 7.0),
        _event("worker_failed", 110, 3, 4, 0.1),
        _event("resumed", 111, 3, 3, 0.0),
        _event("hosts_added", 120, 5, 3, 0.2),
    ]
    times, sizes = world_size_steps(events, end=130)
    assert times == [107, 110, 120, 130], "the world trains from when the first generation synced"
    assert sizes == [4, 3, 5, 5]


def test_throughput_counts_reports_per_second():
    centres, rates = throughput([i * 0.1 for i in range(101)], bins=10)  # 10 reports/s for 10 s
    assert len(centres) == 10
    assert all(r == pytest.approx(10, rel=0.15) for r in rates)


def test_timeline_png_is_written(tmp_path):
    from matplotlib.image import imread

    events = [_event("start", 0, 4, 0, 7.0), _event("worker_failed", 5, 3, 4, 0.1)]
    out = plot_timeline(events, [i * 0.05 for i in range(200)], tmp_path / "sub" / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(out).shape[1] >= 800


def test_timeline_with_nothing_to_plot_says_so(tmp_path):
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_timeline([], [], tmp_path / "t.png")
