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

import pickle
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from itertools import groupby, repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator, Sequence


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


def assign_ranks(workers: Sequence[LiveWorker]) -> Plan:
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
    ids: list[str] = []
    hosts: list[str] = []
    for host, members in by_host.items():
        ids += members
        hosts += repeat(host, len(members))
    return Plan(ids, hosts)


def _slots(ids: list[str], hosts: list[str]) -> dict[str, WorkerSlot]:
    """The slots of workers in rank order, each host's contiguous (`Plan`'s rule, as `assign_ranks` orders).

    Built as columns, a host at a time, then every slot at once by zip and
    map, in C: a publish at thousands of workers reads them all.
    """
    runs = [len(list(run)) for _, run in groupby(hosts)]  # each host's workers, in host order
    widest = max(runs, default=0)
    cross_sizes = [0] * widest  # per local rank: how many hosts have a worker there
    for n in runs:
        for local_rank in range(n):
            cross_sizes[local_rank] += 1
    local_ranks: list[int] = []
    local_sizes: list[int] = []
    cross_ranks: list[int] = []
    seen = [0] * widest
    for n in runs:
        local_ranks += range(n)
        local_sizes += repeat(n, n)
        cross_ranks += seen[:n]
        for local_rank in range(n):
            seen[local_rank] += 1
    cross = [cross_sizes[local_rank] for local_rank in local_ranks]
    size = len(ids)
    make = partial(tuple.__new__, WorkerSlot)  # a C call per slot, not WorkerSlot._make's Python frame
    rows = zip(ids, hosts, range(size), repeat(size), local_ranks, local_sizes, cross_ranks, cross, strict=False)
    return dict(zip(ids, map(make, rows), strict=True))


class Plan(Mapping[str, WorkerSlot]):
    """One generation: each member's slot, by worker id, in rank order (read-only).

    Kept as the members in rank order and their hosts (each host's workers
    contiguous); a slot's ranks are built when one is first read (`_slots`),
    once per plan. So a plan that loses members (`without`) costs the
    driver copies of two lists, not a slot per member: at thousands of
    workers building the slots is milliseconds, and a death publishes a
    plan whose every slot changed (its `size`). Membership, a member's rank
    and iteration never build them. A plan made by `without` pickles as the
    plan it came from (pickled once, then reused as bytes) and the
    positions it dropped, so the driver's snapshot after a death re-pickles
    what the death changed.
    """

    __slots__ = ("_ids", "_hosts", "_at", "_root", "_drop", "_gone", "_built", "_blob")

    def __init__(self, ids: list[str], hosts: list[str]) -> None:
        """`ids` in rank order, `hosts[i]` the host of `ids[i]`, each host's workers contiguous."""
        self._ids = ids
        self._hosts = hosts
        self._at = dict(zip(ids, range(len(ids)), strict=True))  # position in the root plan
        self._root: Plan = self  # the plan whose positions `_at` gives
        self._drop: list[int] = []  # the root's positions this plan dropped, ascending
        self._gone: frozenset[str] = frozenset()  # the root's members this plan dropped
        self._built: dict[str, WorkerSlot] | None = None
        self._blob: bytes | None = None  # a root's ids and hosts, pickled once

    # ---- the mapping -------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._at and worker_id not in self._gone

    def __getitem__(self, worker_id: str) -> WorkerSlot:
        if self._built is None:
            self._built = _slots(self._ids, self._hosts)
        return self._built[worker_id]

    def __repr__(self) -> str:
        return f"Plan({dict(self)!r})"

    def rank(self, worker_id: str) -> int | None:
        """`worker_id`'s rank, or None if it is not a member; without building any slot."""
        at = self._at.get(worker_id)
        if at is None or worker_id in self._gone:
            return None
        return at - bisect_left(self._drop, at)

    def view(self) -> Plan:
        """The same plan as another object, whose slots, once read, are its own: the plan a publish hands the
        shell, so that the slots the shell reads are freed with its action, not when the core moves on."""
        plan = Plan.__new__(Plan)
        plan._ids, plan._hosts, plan._at, plan._root = self._ids, self._hosts, self._at, self._root
        plan._drop, plan._gone = self._drop, self._gone
        plan._built = plan._blob = None
        return plan

    def ids_except(self, skip: Collection[str]) -> list[str]:
        """The members in rank order, less those of `skip` (by position: no pass over every member in Python)."""
        ids = self._ids.copy()
        for p in sorted((p for p in map(self.rank, skip) if p is not None), reverse=True):
            del ids[p]
        return ids

    def host(self, worker_id: str) -> str:
        """A member's host."""
        rank = self.rank(worker_id)
        if rank is None:
            raise KeyError(worker_id)
        return self._hosts[rank]

    # ---- a plan less some members ---------------------------------------------------------
    def without(self, gone: Collection[str], key: Callable[[str], Any], rekeyed: Collection[str] = ()) -> Plan | None:
        """This plan less the members `gone`, the others in the same order, if that is the plan `assign_ranks`
        gives them; else None (plan them whole).

        `key(w)` is member `w`'s place in `assign_ranks`' order now
        (`order_key`), and `rekeyed` the members whose key changed since this
        plan was made (a newcomer that synced since holds the state): only
        the neighbours a removal or a new key brought together are compared,
        so the cost is two lists' copies and a few comparisons.
        """
        positions = {w: p for w in gone if (p := self.rank(w)) is not None}
        drop = sorted(positions.values())
        ids, hosts = self._ids, self._hosts
        if drop:
            ids, hosts = ids.copy(), hosts.copy()
            for p in reversed(drop):
                del ids[p], hosts[p]
        touched: set[int] = set()
        for i, p in enumerate(drop):
            touched.update((p - i - 1, p - i))  # the survivors on each side of it are neighbours now
        for w in rekeyed:
            p = self.rank(w)
            if p is not None and w not in positions:
                touched.add(p - bisect_left(drop, p))
        n = len(ids)
        if not all(_in_order(ids, hosts, p, key) for p in touched if 0 <= p < n):
            return None
        if not drop:
            return self
        root = self._root
        in_root = sorted([*self._drop, *(root._at[w] for w in positions)])
        if len(in_root) > max(16, len(root._ids) // 8):
            return Plan(ids, hosts)  # a new root: the dropped positions would cost more than they save
        return root._dropping(ids, hosts, in_root)

    def _dropping(self, ids: list[str], hosts: list[str], drop: list[int]) -> Plan:
        """A root's plan less its positions `drop` (ascending): `ids` and `hosts` are what is left."""
        plan = Plan.__new__(Plan)
        plan._ids, plan._hosts, plan._at, plan._root = ids, hosts, self._at, self
        plan._drop, plan._gone = drop, frozenset(self._ids[p] for p in drop)
        plan._built = plan._blob = None
        return plan

    # ---- pickled as its root (pickled once, then reused as bytes) and the positions dropped ------------
    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """The root's bytes go out of band where the pickler takes buffers (the driver's snapshot: a part of
        its own in the GCS, written once)."""
        root = self._root
        if root._blob is None:
            root._blob = pickle.dumps((root._ids, root._hosts), protocol=pickle.HIGHEST_PROTOCOL)
        blob = pickle.PickleBuffer(root._blob) if protocol >= 5 and len(root._blob) >= OUT_OF_BAND else root._blob
        return (_load_plan, (blob, self._drop))


def _load_plan(blob: bytes | memoryview, drop: list[int]) -> Plan:
    ids, hosts = pickle.loads(blob)  # the driver's own snapshot, signed (`driver/shell/snapshot.py`)
    root = Plan(ids, hosts)
    root._blob = bytes(blob)
    if not drop:
        return root
    dropped = set(drop)
    kept = [p for p in range(len(ids)) if p not in dropped]
    return root._dropping([ids[p] for p in kept], [hosts[p] for p in kept], list(drop))


def _in_order(ids: list[str], hosts: list[str], p: int, key: Callable[[str], Any]) -> bool:
    """Whether position `p` sits where `assign_ranks` puts it: after its host's previous worker, and its host's
    first worker between the previous and the next host's first."""
    host = hosts[p]
    if p > 0 and hosts[p - 1] == host and not key(ids[p - 1]) < key(ids[p]):
        return False
    if p + 1 < len(ids) and hosts[p + 1] == host and not key(ids[p]) < key(ids[p + 1]):
        return False
    start = p
    while start > 0 and hosts[start - 1] == host:
        start -= 1
    if start > 0:
        before = start - 1
        while before > 0 and hosts[before - 1] == hosts[start - 1]:
            before -= 1
        if not key(ids[before]) < key(ids[start]):
            return False
    end = p
    while end + 1 < len(ids) and hosts[end + 1] == host:
        end += 1
    return end + 1 >= len(ids) or key(ids[start]) < key(ids[end + 1])


def order_key(worker: LiveWorker) -> tuple[bool, int]:
    """`assign_ranks`' order: holders of the trained state first, each oldest first."""
    return (not worker.holds, worker.seq)


OUT_OF_BAND = 16 * 1024  # bytes kept and pickled out of band from this size on (smaller go with the rest)

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
