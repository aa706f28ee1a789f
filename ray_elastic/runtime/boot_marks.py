"""A worker's boot, stamped: when it passed each point of its start, and the phases between them.

Each mark is a wall-clock time (`time.time()`, comparable across the
processes of one machine or a synced cluster) set the first time the worker
passes its point; a later reset's join is no boot and leaves them alone. The
worker actor, the run loop and `Membership` set them; they live on the
process's `WorkerContext` (`boot_marks`), cost a dict entry each and are
never shipped: a benchmark reads them inside `train_fn`
(`ray_elastic.runtime.process.current().boot_marks`), adds its own ends
(when it offered the host, the first step) and splits the boot with
`phases`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

# a boot's points, in the order a newcomer passes them; the first two and the last are a benchmark's own
ORDER = (
    "offered",  # the host was offered to discovery (the benchmark's)
    "spawned",  # the driver decided to start the worker (the benchmark's: from the hosts_added event)
    "actor_entered",  # the worker actor's constructor entered: Ray placed the group and started the process
    "actor_left",  # its constructor returned (the runtime built, the driver link made)
    "run_entered",  # run() entered: the driver's call reached the actor
    "unpacked",  # train_fn's payload unpickled (its module imported): train_fn is called next
    "loop_entered",  # the first @elastic.run call: the user's set-up (imports, model, state) done
    "backend_loaded",  # the collective backend imported
    "ready",  # the join preparations done (state buffers, garbage collected) and WorkerReady told
    "admitted",  # the generation that admits this worker seen
    "ring_formed",  # that generation's ring formed
    "synced",  # the first sync done: the state received
    "first_step",  # the first step done (the benchmark's)
)

# what each phase is, named by the points it runs between
LABELS = {
    ("offered", "spawned"): "discovery poll",
    ("spawned", "actor_entered"): "placement group + process start",
    ("offered", "actor_entered"): "discovery poll + placement group + process start",
    ("actor_entered", "actor_left"): "actor constructor",
    ("actor_left", "run_entered"): "run() call",
    ("run_entered", "unpacked"): "shipping train_fn",
    ("unpacked", "loop_entered"): "user's set-up",
    ("loop_entered", "backend_loaded"): "backend import",
    ("backend_loaded", "ready"): "join preparations + ready",
    ("loop_entered", "ready"): "join preparations + ready",
    ("ready", "admitted"): "waiting for admission",
    ("admitted", "ring_formed"): "ring join",
    ("ring_formed", "synced"): "state receipt",
    ("synced", "first_step"): "first step",
}


class BootMarks(dict[str, float]):
    """The points of `ORDER` this worker passed, and when."""

    def mark(self, point: str, at: float | None = None) -> None:
        """Stamp `point` now (or `at`), unless it was stamped already."""
        if point not in self:
            self[point] = time.time() if at is None else at


@dataclass(frozen=True)
class Phase:
    """The boot's time from mark `start` to mark `end`."""

    start: str
    end: str
    seconds: float

    @property
    def label(self) -> str:
        return LABELS.get((self.start, self.end), f"{self.start} -> {self.end}")


def phases(marks: Mapping[str, float]) -> list[Phase]:
    """The boot split at every point of `ORDER` that `marks` holds, in that order (a missing point merges two).

    The phases tile the time from the first mark present to the last, so
    their seconds add up to the whole boot. Marks not in `ORDER` are left out.
    """
    present = [point for point in ORDER if point in marks]
    return [Phase(a, b, marks[b] - marks[a]) for a, b in zip(present, present[1:], strict=False)]
