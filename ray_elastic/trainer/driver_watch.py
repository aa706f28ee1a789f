"""Following a run from `fit()`'s thread: polling the driver, fetching reports, showing progress, cleaning up.

`fit()` starts the run's actors and then only watches: it asks the driver
for its status twice a second (bounded; a driver that answers nothing for
`elastic_timeout` fails the run, saying so at each missed answer), hands
each of rank 0's new reports to `Reports` (and the user's `on_report`), and
shows the progress bar and event lines. Whatever way the run ends, the
clean-up leaves no actor, placement group or autoscaler share behind,
through a second Ctrl-C too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.protocol import RunOutcome
from ray_elastic.teardown import remove_run
from ray_elastic.trainer.progress_bar import Progress
from ray_elastic.trainer.ray_output import worker_death_dumps_hidden

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger(__name__)

_POLL_S = 0.5
_STATUS_TIMEOUT_S = 30.0  # a driver that does not answer a status query for this long is retried
_STOP_TIMEOUT_S = 5.0  # delivering the stop request to the driver of an interrupted fit()
_CLEANUP_TIMEOUT_S = 30.0  # listing and removing the run's actors and placement groups in Ray's GCS


class Reports:
    """Rank 0's reports as `fit()` fetches them: the newest `keep` kept, the others counted."""

    def __init__(self, keep: int | None, on_report: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.kept: deque[tuple[float, dict[str, Any]]] = deque(maxlen=keep)
        self.seen = 0  # run-wide index of the next report to fetch
        self._on_report = on_report

    def take(self, first: int, batch: list[tuple[float, dict[str, Any]]]) -> list[tuple[float, dict[str, Any]]]:
        """Keep the reports of `batch` (starting at run-wide index `first`) not seen yet; return them."""
        new = batch[max(0, self.seen - first) :]
        self.kept.extend(new)
        self.seen = max(self.seen, first + len(batch))
        if self._on_report is not None:
            for stamp, metrics in new:  # a callable that asks for each report's time (Tune's relay) gets it too
                self._on_report(*((metrics, stamp) if getattr(self._on_report, "takes_stamp", False) else (metrics,)))
        return new

    @property
    def dropped(self) -> int:
        return self.seen - len(self.kept)


def follow(
    driver: Any, run_ref: Any, reports: Reports, note: str | None, verbose: int, elastic_timeout: float
) -> RunOutcome:
    """Wait for the driver, collecting its reports and showing progress and event lines until it ends.

    `note`: a line about the run shown before the first progress (what it keeps for its datasets).
    """
    progress = Progress(enabled=verbose > 0)
    if note:
        progress.note(note)
    try:
        with worker_death_dumps_hidden():  # the event lines say which worker died; Ray's dump stays in its logs
            return poll_driver(driver, run_ref, progress, reports, elastic_timeout)
    except ray.exceptions.RayActorError as e:
        # the driver holds the membership; without it the workers cannot be re-formed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return RunOutcome(ok=False, error=f"the run's driver actor died ({first}); the run cannot continue")
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping the run and releasing its workers")
        raise
    finally:
        progress.close()


def next_events_from(first: int, events: list[dict[str, Any]]) -> int:
    """The run-wide event number the next status query asks from: the first event whose reset still runs.

    Its line ("...; recovered in 0.12 s") waits for the reset's end, and the
    driver sends an event again only while its reset runs: asking from past
    it would miss the one answer in which it has ended, and the line would
    show only when the run ends (the start line of a run that is
    interrupted, never).
    """
    for i, ev in enumerate(events):
        if ev["reset_duration"] is None:
            return first + i
    return first + len(events)


def poll_driver(driver: Any, run_ref: Any, progress: Any, reports: Reports, elastic_timeout: float) -> RunOutcome:
    """The run's outcome; a driver alive but answering nothing for `elastic_timeout` fails it (said each time)."""
    limit = elastic_timeout
    answered = time.monotonic()  # when the driver last answered a status query
    events_seen = 0  # the driver sends only the events after these (and those whose reset goes on)
    while True:
        ready, _ = ray.wait([run_ref], timeout=_POLL_S)
        if ready:
            outcome: RunOutcome = ray.get(run_ref)
            progress.update(
                {
                    "state": "done" if outcome.ok else "failed",
                    "events": outcome.events,
                    "resets": outcome.resets,
                    "metrics": reports.take(outcome.metrics_from, outcome.metrics),
                }
            )
            return outcome
        try:
            status = ray.get(driver.status.remote(reports.seen, events_seen), timeout=_STATUS_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            silent = time.monotonic() - answered
            if silent > limit:
                return RunOutcome(
                    ok=False,
                    error=f"the run's driver actor answered no status query for {silent:.0f} s "
                    f"(elastic_timeout={limit:g} s): it is stuck, and no failure of the run can be handled",
                )
            logger.warning("the run's driver actor has answered no status query for %.0f s", silent)
            continue
        answered = time.monotonic()
        events_seen = next_events_from(status.events_from, status.events)
        progress.update({**vars(status), "metrics": reports.take(status.metrics_from, status.metrics)})


def coordinator_node() -> str:
    """Where the driver and KV actors run: the head node, which stays while workers come and go."""
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return ray.get_runtime_context().get_node_id()


def cleanup(driver: Any, kv: Any, run_id: str, namespace: str, graceful: bool) -> None:
    """Leave no actor, no placement group and no autoscaler share of this run behind.

    The work runs in a thread of its own and this waits for it, bounded by
    `_STOP_TIMEOUT_S + _CLEANUP_TIMEOUT_S`, through further Ctrl-Cs: an
    impatient second Ctrl-C must not leave placement groups that block the
    next `fit()`.
    """

    finished = threading.Event()

    def work() -> None:
        try:
            release()
        finally:
            finished.set()

    def release() -> None:
        if driver is not None:
            if not graceful:
                try:
                    # the driver kills its workers and removes their placement groups
                    ray.get(driver.stop.remote("fit() was interrupted"), timeout=_STOP_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - a dead driver is cleaned up below
                    pass
            ray.kill(driver.handle, no_restart=True)
        if kv is not None:
            ray.kill(kv.handle, no_restart=True)
        remove_run(run_id, namespace, "fit()")

    cleaner = threading.Thread(target=work, name="ray-elastic-cleanup", daemon=True)
    cleaner.start()
    deadline = time.monotonic() + _STOP_TIMEOUT_S + _CLEANUP_TIMEOUT_S
    interrupted = False
    # an Event, not join(): a join interrupted by Ctrl-C leaves is_alive() False on Python 3.10-3.11
    while not finished.is_set() and time.monotonic() < deadline:
        try:
            finished.wait(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            interrupted = True
            logger.warning(
                "still releasing the run's workers and placement groups (at most %.0f s)", _CLEANUP_TIMEOUT_S
            )
    if not finished.is_set():
        # the GCS answers these; a GCS that hangs must not hang fit()'s caller
        logger.error(
            "could not remove the actors and placement groups of namespace %s within %g s; some may be left behind",
            namespace,
            _STOP_TIMEOUT_S + _CLEANUP_TIMEOUT_S,
        )
    if interrupted:
        raise KeyboardInterrupt
