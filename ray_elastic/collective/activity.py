"""When this process last entered or left a blocking collective.

The driver's stuck-rank check reads it through the worker's control thread:
a member that shows no activity while the others time out is stuck in user
code. The backends and the DDP hook mark it; they sit below the worker's
runtime, so the marks live here, one per process (one worker actor is one
process), and the runtime reads them rather than the collectives reaching up
into the runtime.
"""

from __future__ import annotations

import time


class ActivityMarks:
    """When this worker last started or finished a collective, and whether it is inside one now."""

    def __init__(self) -> None:
        self.last = time.time()
        self.in_collective = False

    def mark(self, inside: bool) -> None:
        self.in_collective = inside
        self.last = time.time()


MARKS = ActivityMarks()  # this process's


def collective_activity(inside: bool) -> None:
    """Backends call this entering (True) and leaving (False) a blocking collective."""
    MARKS.mark(inside)
