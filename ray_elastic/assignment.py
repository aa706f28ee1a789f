"""Pure decisions about who trains where: no Ray, unit-tested in milliseconds.

- `assign_ranks` gives each live worker its rank, local rank and cross rank
  for one generation. Workers that hold the trained state (they finished a
  sync) come first, oldest first, then newcomers, oldest first; hosts are
  ordered by their first worker in that order. So rank 0, whose commit
  `sync()` hands to every rank, always holds the newest commit among the
  members: a newcomer that never synced is never rank 0 over a holder.
- `plan_scaling` compares the live workers with what discovery offers and
  decides which workers leave and how many newcomers start on which host,
  capped at `max_workers`.
- `Cooldown` keeps hosts whose workers failed out of new assignments for an
  exponentially growing time inside `cooldown_range`, then offers them again
  (Horovod bans such hosts for good by default; a one-host job then dies of a
  single worker crash).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence


# NamedTuples, not frozen dataclasses: the driver builds one per worker per decision, and at
# 8000 workers a frozen dataclass's __init__ alone costs tens of milliseconds
class LiveWorker(NamedTuple):
    """A worker that exists now: its id, its host, its spawn order (unique: the driver counts spawns),
    and whether it holds the trained state (it finished a sync)."""

    worker_id: str
    host: str
    seq: int  # spawn order: smaller is older
    holds: bool = False


class WorkerSlot(NamedTuple):
    """One worker's place in one generation (Horovod's rank vocabulary)."""

    worker_id: str
    host: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def assign_ranks(workers: Sequence[LiveWorker]) -> dict[str, WorkerSlot]:
    """Ranks for `workers`: holders of the trained state before newcomers, each oldest first.

    Hosts come in the order of their first worker in that order, so rank 0
    is the oldest holder (the oldest worker when none holds). Ranks are
    contiguous per host. `cross_rank` is the host's index among the
    hosts that have a worker at the same local rank, and `cross_size` is the
    number of such hosts, as in Horovod.
    """
    by_host: dict[str, list[str]] = {}
    ordered = sorted(workers, key=_BY_AGE)
    # holders first, each group still oldest first: a second, stable sort on a bool key (reverse keeps the
    # order of equals) costs a third of one tuple-keyed sort, which at thousands of workers is a death's cost
    ordered.sort(key=_HOLDS, reverse=True)
    for w in ordered:
        by_host.setdefault(w.host, []).append(w.worker_id)
    # dicts keep insertion order: hosts come in the order of their oldest worker
    size = len(workers)
    widest = max(map(len, by_host.values()), default=0)
    cross_sizes = [0] * widest  # per local rank: how many hosts have a worker there
    for ids in by_host.values():
        for local_rank in range(len(ids)):
            cross_sizes[local_rank] += 1
    slots: dict[str, WorkerSlot] = {}
    rank = 0
    cross_seen = [0] * widest
    make = partial(tuple.__new__, WorkerSlot)  # a C call per slot, not WorkerSlot._make's Python frame
    # one host's slots are built by zip and map, in C: this runs for every worker at every reset
    for host, ids in by_host.items():
        n = len(ids)
        ranks = range(rank, rank + n)
        rows = zip(ids, repeat(host), ranks, repeat(size), range(n), repeat(n), cross_seen, cross_sizes, strict=False)
        slots.update(zip(ids, map(make, rows), strict=True))
        for local_rank in range(n):
            cross_seen[local_rank] += 1
        rank += n
    return slots


_BY_AGE = attrgetter("seq")  # oldest first; seq is unique, so no tie-break is needed


_HOLDS = attrgetter("holds")


@dataclass(frozen=True)
class ScalePlan:
    """What to change: workers to remove gracefully, newcomers per host."""

    remove: tuple[str, ...] = ()
    add: Mapping[str, int] = field(default_factory=dict)

    @property
    def is_noop(self) -> bool:
        return not self.remove and not any(self.add.values())


def plan_scaling(
    workers: Sequence[LiveWorker],
    hosts: Mapping[str, int],
    host_first_seen: Mapping[str, float],
    cooling: Collection[str],
    max_workers: int,
) -> ScalePlan:
    """Decide removals and additions so the world fits `hosts` and `max_workers`.

    - Workers on hosts that discovery no longer offers leave.
    - A host that offers fewer slots than it has workers loses its youngest.
    - Beyond `max_workers`, the youngest workers leave.
    - Free slots are filled oldest host first, skipping cooling hosts, until
      `max_workers`. Workers already on a cooling host stay: only new
      workers are held back.
    """
    by_host: dict[str, list[LiveWorker]] = {}
    for w in sorted(workers, key=_BY_AGE):
        by_host.setdefault(w.host, []).append(w)
    remove: list[LiveWorker] = []
    kept: list[LiveWorker] = []
    for host, members in by_host.items():
        slots = max(0, hosts.get(host, 0))
        kept.extend(members[:slots])
        remove.extend(members[slots:])
    if len(kept) > max_workers:
        kept.sort(key=_BY_AGE)
        remove.extend(kept[max_workers:])
        kept = kept[:max_workers]
    counts: dict[str, int] = {}
    for w in kept:
        counts[w.host] = counts.get(w.host, 0) + 1
    room = max_workers - len(kept)
    add: dict[str, int] = {}
    order = sorted(hosts, key=lambda h: (host_first_seen.get(h, float("inf")), h))
    for host in order:
        if room <= 0:
            break
        if host in cooling:
            continue
        free = max(0, hosts[host] - counts.get(host, 0))
        n = min(free, room)
        if n:
            add[host] = n
            room -= n
    return ScalePlan(remove=tuple(w.worker_id for w in remove), add=add)


class Cooldown:
    """Exponential back-off for hosts whose workers failed.

    The n-th failure of a host within `forget_after` seconds of being offered
    again keeps it out for `min(max_s, min_s * 2 ** (n - 1))` seconds; after that
    the host is offered again. A host that stays healthy for `forget_after`
    (default `max_s`) after being offered again starts over from `min_s`.
    """

    def __init__(self, min_s: float, max_s: float, forget_after: float | None = None) -> None:
        if min_s < 0 or max_s < min_s:
            raise ValueError(f"cooldown_range must satisfy 0 <= min <= max, got ({min_s}, {max_s})")
        self.min_s = min_s
        self.max_s = max_s
        self.forget_after = max_s if forget_after is None else forget_after
        self._failures: dict[str, int] = {}
        self._last_failure: dict[str, float] = {}
        self._until: dict[str, float] = {}

    def record_failure(self, host: str, now: float) -> float:
        """Start (or extend) the host's cool-down; returns its length in seconds."""
        last = self._last_failure.get(host)
        n = self._failures.get(host, 0)
        # quiet time counts from when the host was offered again, not from inside its ban
        if last is not None and now - self._until.get(host, last) > self.forget_after:
            n = 0
        n += 1
        self._failures[host] = n
        self._last_failure[host] = now
        length = min(self.max_s, self.min_s * 2 ** (n - 1))
        self._until[host] = max(self._until.get(host, 0.0), now + length)
        return length

    def forget(self, now: float) -> None:
        """Drop the hosts whose failures `record_failure` would no longer count (quiet for `forget_after`)."""
        for host in [h for h, until in self._until.items() if now - until > self.forget_after]:
            del self._failures[host], self._last_failure[host], self._until[host]

    def is_cooling(self, host: str, now: float) -> bool:
        return self._until.get(host, 0.0) > now

    def remembers(self, host: str) -> bool:
        """Whether a failure of `host` still counts (it cooled down, or cools down now)."""
        return host in self._until

    def cooling(self, now: float) -> set[str]:
        return {h for h, until in self._until.items() if until > now}

    def next_release(self, now: float) -> float | None:
        """When the next cooling host is offered again, or None if none cools."""
        pending = [until for until in self._until.values() if until > now]
        return min(pending) if pending else None
