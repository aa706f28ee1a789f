"""The run's actors log to a file of the Ray session, not to the terminal of `fit()`'s caller.

The driver and worker actors call `keep_in_session_log` once: the
`ray_elastic` logger then writes to `<session>/logs/ray_elastic/<process>-<pid>.log`,
beside Ray's own worker logs (as Ray Train does for its controller and
workers), and `fit()` shows one line per event itself
(`trainer/progress_bar.py`). What `train_fn` prints or logs is not touched.
"""

from __future__ import annotations

import logging
import os

import ray

from ray_elastic import ray_private

_PACKAGE = "ray_elastic"


def session_log_dir() -> str | None:
    """`<session>/logs/ray_elastic` of the Ray session this process is connected to, or None outside Ray."""
    node = ray_private.global_node()
    if node is None:
        return None
    return os.path.join(node.get_logs_dir_path(), _PACKAGE)


def keep_in_session_log(process: str) -> str | None:
    """In one of the run's actors: the `ray_elastic` logger writes to a file of the Ray session, not to stderr.

    `process` names the file (`driver-<run>`, `worker-<run>-<worker>`); the
    PID is added, so a restarted driver starts a file of its own. INFO and
    above are kept (reset details, checkpoint timings); nothing is
    forwarded to the terminal of `fit()`'s caller, which shows the events
    itself. Returns the file's path (None outside a Ray worker process:
    logging unchanged).
    Calling it again in the same process changes nothing.
    """
    if ray_private.worker_mode() != ray.WORKER_MODE:
        return None  # fit()'s own process (a driver of Ray's): its logging is the user's
    logger = logging.getLogger(_PACKAGE)
    for handler in logger.handlers:
        if isinstance(handler, _SessionLog):
            return handler.baseFilename
    directory = session_log_dir()
    if directory is None:
        return None
    os.makedirs(directory, exist_ok=True)
    handler = _SessionLog(os.path.join(directory, f"{process}-{os.getpid()}.log"), delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s -- %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the root logger of a Ray worker writes to stderr, which Ray forwards
    return handler.baseFilename


class _SessionLog(logging.FileHandler):
    """The handler `keep_in_session_log` adds (a class of its own, so that it is found again)."""
