"""Which commit a rank holds, and whether it may adopt rank 0's.

Every commit carries a `CommitId`: a lineage (fresh in each process until
its first sync, then rank 0's) and how many saves it has seen since. Ranks
that trained in lockstep since a sync hold equal ids exactly when they hold
bitwise-equal state (`state/sync_plan.py` plans a sync from their
fingerprints). Before a sync every rank takes rank 0's commit count, unless
`judge_adoption` finds it would undo training. Pure logic; the runtime and
the state classes use it.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class CommitId:
    """Which commit a rank holds: `count` saves into the state first synced as `lineage`."""

    lineage: str
    count: int = 0

    def next(self) -> CommitId:
        return CommitId(self.lineage, self.count + 1)

    def fingerprint(self) -> int:
        """A positive 63-bit number; equal ids give equal numbers, different ones differ but by a 2^-63 chance."""
        digest = hashlib.blake2b(f"{self.lineage}:{self.count}".encode(), digest_size=8).digest()
        return (int.from_bytes(digest, "little") & (2**63 - 1)) or 1


def fresh_commit_id() -> CommitId:
    """An id no other rank holds: for a state built (or loaded, or torn) in this process alone."""
    return CommitId(uuid.uuid4().hex)


def judge_adoption(held_lineage: str, held_commits: int, root_lineage: str, root_commits: int) -> str | None:
    """None if a rank holding `held_commits` commits of `held_lineage` may adopt rank 0's; else why not.

    Within one lineage rank 0's commit is one every rank passed through (a
    torn step rolls back to it). From another lineage it is older exactly
    when it has seen fewer of the run's commits: adopting it would undo
    training, which is never done silently.
    """
    if held_lineage == root_lineage or root_commits >= held_commits:
        return None
    return (
        f"rank 0 holds commit {root_commits}, older than commit {held_commits} held here; "
        f"adopting it would undo {held_commits - root_commits} commit(s) of training"
    )
