"""The event lines `fit()` prints, fed by status polls: an event first seen while its reset runs prints once it ends."""

from __future__ import annotations

import logging

from test_driver_core import Script

from ray_elastic.driver.core import messages as m
from ray_elastic.trainer.driver_watch import next_events_from
from ray_elastic.trainer.progress_bar import Progress


def poll(s: Script, progress: Progress, seen: int) -> int:
    """One status query as `poll_driver` makes it: the events from `seen` on, shown; where to ask from next."""
    first, events = s.core.events.since(seen)
    as_sent = [e.to_dict() for e in events]
    progress.update({"state": "running", "events": as_sent, "world_size": len(s.core.plan)})
    return next_events_from(first, as_sent)


def test_the_start_line_polled_while_the_first_sync_runs_prints_once_it_ended(caplog):
    """The notebook test waited 120 s for "started with" while the run trained: the one poll that fell between
    generation 1's publish and its sync got the start event still open (no line yet), and the next poll asked
    from past it, so the driver never sent it again."""
    s = Script(min_workers=2)
    progress = Progress(enabled=True)  # no terminal here: the lines go to the ray_elastic logger
    with caplog.at_level(logging.INFO, logger="ray_elastic"):
        s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
        s.send(*[m.WorkerReady(a.worker_id) for a in s.of(m.Spawn)])
        seen = poll(s, progress, 0)
        assert not lines(caplog), "its reset runs: no line yet"
        s.sync(s.of(m.Publish)[0])
        seen = poll(s, progress, seen)
        assert [line.split(" in ")[0] for line in lines(caplog)] == ["[ray-elastic] started with 3 workers"]
        s.send(m.WorkerDied("w3", "SIGKILL", node_alive=True))
        seen = poll(s, progress, seen)
        s.sync(s.of(m.Publish)[-1])
        seen = poll(s, progress, seen)
        poll(s, progress, seen)
    progress.close()
    shown = lines(caplog)
    assert len(shown) == 2 and "w3 (rank 2) on node C died" in shown[1] and "recovered in" in shown[1], shown


def lines(caplog) -> list[str]:
    """What the progress display printed (the core's own log records aside)."""
    return [r.getMessage() for r in caplog.records if r.name == "ray_elastic"]
