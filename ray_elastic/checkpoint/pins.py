"""Pins: a checkpoint kept from pruning, by every writer, while someone copies it (Tune's hand-over).

A pin is an empty file beside the checkpoints, `.pin-<seconds>s-<token>-<checkpoint>`,
naming the checkpoint and how long the pin lasts, not until when. Whoever
pins (Tune's trial) and the writer that prunes (rank 0) are on different
machines, whose wall clocks disagree; so a writer counts a pin's seconds on
its own monotonic clock from when it first sees the pin. No two machines'
clocks are compared: a skewed one neither lapses a pin early nor keeps it
forever, and a pinner killed while it holds a pin keeps the checkpoint no
longer than the pin's seconds after a writer first sees it.

Kept apart from `store.py` because a pin is a protocol between processes
with state of its own (when this process first saw each pin), while the
store decides which checkpoints there are and which are newest.
"""

from __future__ import annotations

import contextlib
import math
import re
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

_PIN = re.compile(r"^\.pin-(\d+)s-[0-9a-f]+-(checkpoint_[0-9a-z-]+)$")  # how long it lasts, not until when


class Pins:
    """The pins in the directory `root` of the fsspec filesystem `fs`, as one process sees them.

    `clock`: this process's monotonic clock, on which a pin's seconds are counted.
    """

    def __init__(self, fs: Any, root: str, clock: Callable[[], float]) -> None:
        self._fs = fs
        self._root = root
        self._clock = clock
        self._seen: dict[str, float] = {}  # pin file -> when this process first saw it, on `clock`

    def active(self, names: list[str]) -> set[str]:
        """The checkpoints pinned now, among the directory's entries `names`.

        A pin lasts its seconds from when this process first saw it, on its own clock.
        """
        now = self._clock()
        seen, pinned = {}, set()
        for m in map(_PIN.match, names):
            if m is not None:
                first = seen[m.group(0)] = self._seen.get(m.group(0), now)
                if now - first < int(m.group(1)):
                    pinned.add(m.group(2))
        self._seen = seen  # pins removed by their owners are forgotten
        return pinned

    @contextlib.contextmanager
    def hold(self, name: str, seconds: float) -> Iterator[None]:
        """Pin the checkpoint named `name` for the block, at most `seconds` after a writer first sees the pin."""
        pin = f"{self._root}/.pin-{math.ceil(seconds)}s-{uuid.uuid4().hex[:8]}-{name}"
        with self._fs.open(pin, "wb") as f:
            f.write(b"")
        try:
            yield
        finally:
            try:
                self._fs.rm(pin, recursive=True)
            except Exception:  # noqa: BLE001 - a pin left behind lapses by itself
                pass
