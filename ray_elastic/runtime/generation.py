"""`Generation`: what this worker is in one generation (its number, its slot, its ring), as a value.

A reset replaces all three at once, so they are handed out together,
frozen, by `WorkerContext.joined()` (which joins first) and
`WorkerContext.generation_now()` (None while the worker is in no ring).
A function that works on one generation's ring takes a `Generation`, so its
signature says that it depends on the current rank and ring and not only on
the process; it holds one for a call, never across a reset (the next
generation's ring is another object).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.collective.base import CollectiveGroup


@dataclass(frozen=True)
class Generation:
    """One generation as this worker joined it.

    Args:
        number: the generation's number (the driver's; 1 is the first).
        slot: this worker's place in it (rank, size, host, local and cross ranks).
        ring: its collective group, closed when the worker leaves the generation.
    """

    number: int
    slot: WorkerSlot
    ring: CollectiveGroup

    @property
    def rank(self) -> int:
        return self.slot.rank

    @property
    def size(self) -> int:
        return self.slot.size
