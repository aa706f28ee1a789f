"""The copy gate: background copies of a commit hold off while a reset runs.

From a reset's start (a restore, a graceful interrupt's `keep_live`) until
its sync has returned, the commit's background copies (`commit_buffers.py`)
wait: run beside the ring's re-forming, a survivor's re-copy of its commit
(gigabytes for a large model) would make the reset round grow with the
model. A `wait()` on a held copy lets it go at once (its `hurry` event).
One gate per process: a reset is the whole worker's. Only host copies run
behind it: a device's copies are queued on the caller's stream at once and
take no host time (`commit_buffers.py`).
"""

from __future__ import annotations

import threading

gate = threading.Condition()  # held while the flag below changes; the commit buffers wait on it
_resetting = False


def hold_background_copies() -> None:
    """A reset begins: commit copies started from now wait until `release_background_copies()`."""
    global _resetting
    with gate:
        _resetting = True


def release_background_copies() -> None:
    """The reset's sync returned: held commit copies go on."""
    global _resetting
    with gate:
        _resetting = False
        gate.notify_all()


def wait_for_release(hurry: threading.Event) -> None:
    with gate:
        gate.wait_for(lambda: not _resetting or hurry.is_set())
