"""What Ray itself prints in `fit()`'s terminal, and how a worker's death dump is kept out of it.

`fit()` prints one line per membership event (`progress_bar.py`). Two other
sources would repeat each event in Ray's words:

- The run's own actors log every event in detail. Ray forwards whatever an
  actor writes to stderr to the terminal of the process that started the
  job, as "(DriverHost pid=...) worker w3 ... died: ...". In the run's
  actors, `session_log.keep_in_session_log` sends the `ray_elastic` logger to a file
  under the Ray session's log directory instead
  (`<session>/logs/ray_elastic/driver-<run>-<pid>.log`, `worker-...`),
  beside Ray's own worker logs, as Ray Train does for its controller and
  workers (`logs/train/`). What `train_fn` prints or logs itself is not
  touched: Ray still forwards it.
- When a worker process dies, its raylet publishes a dump to the job
  ("A worker died or was killed while executing a task by an unexpected
  system error ... Worker exit detail ... OOM killer ... ray stop --force
  ... SIGSEGV ..."), which Ray's error listener in `fit()`'s process prints
  as "(raylet) ...". The run handles these deaths (the event line says
  which worker, where, and how long recovery took). While `fit()` runs,
  `worker_death_dumps_hidden` adds that dump to the lines Ray's log
  deduplicator skips, the pattern `RAY_DEDUP_LOGS_SKIP_REGEX` sets when Ray
  is imported (Ray has no switch that can be set later); a pattern the
  user set stays in force, and theirs alone is back after `fit()`. The
  dump stays in Ray's logs (`<session>/logs/events/event_RAYLET.log` on
  the worker's node, and the GCS's `gcs_server.out`). With
  `RAY_DEDUP_LOGS=0` Ray skips nothing, and the dumps show.

A run that fails still says why: `fit()` raises `TrainingFailedError` with
the reason, whatever the actors logged.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import TYPE_CHECKING, Any

from ray_elastic import ray_private

if TYPE_CHECKING:
    from collections.abc import Iterator

# the first words of the raylet's dump for a worker process that died (Ray 2.x)
WORKER_DEATH_DUMP = "A worker died or was killed while executing a task by an unexpected system error"

_lock = threading.Lock()
_hiding = 0  # fit() calls running now (threads): the first installs the pattern, the last removes it
_saved: list[tuple[Any, re.Pattern | None]] = []


@contextlib.contextmanager
def worker_death_dumps_hidden() -> Iterator[None]:
    """While `fit()` runs: Ray's raw dump for a dead worker process is not printed here (see the module)."""
    global _hiding
    with _lock:
        if _hiding == 0:
            _install()
        _hiding += 1
    try:
        yield
    finally:
        with _lock:
            _hiding -= 1
            if _hiding == 0:
                _restore()


def _install() -> None:
    try:
        deduplicators = ray_private.output_deduplicators()
    except ImportError:  # a Ray without these deduplicators: its dumps show, nothing breaks
        return
    for dedup in deduplicators:
        theirs = getattr(dedup, "skip_re", None)
        if not hasattr(dedup, "skip_re"):
            continue
        ours = re.escape(WORKER_DEATH_DUMP)
        dedup.skip_re = re.compile(ours if theirs is None else f"(?:{theirs.pattern})|(?:{ours})")
        _saved.append((dedup, theirs))


def _restore() -> None:
    while _saved:
        dedup, theirs = _saved.pop()
        dedup.skip_re = theirs
