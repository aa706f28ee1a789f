"""Which rows of a dim-0 sharded state each rank of a new world needs, and which live process sends them.

Pure logic, no collective: `ray_elastic.torch.sharded` carries the plans out.

A sharded tensor (an FSDP2 parameter, or its optimizer's moments) is split on
dim 0 by torch's `chunk` rule: with `n` rows over `w` ranks every rank holds
`ceil(n / w)` consecutive rows, the last ones fewer or none (`rows_of`).
After a membership change each rank of the new world needs its new rows.
Every committed shard of the old world lives in the process that owned it
and in one replica on another process (`replica_holder`: the next rank on
another host, so one host's loss loses no shard). `plan_reshard` picks, for
every run of rows a new rank needs, exactly one live holder: the new rank
itself where it already holds them (nothing moves), else the shard's owner,
else its replica. So the bytes that move are the least any plan can move:
the rows each new rank needs and does not hold (`ReshardPlan.minimum_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence


def rows_of(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rows `[start, stop)` of an `n`-row tensor that `rank` of `world` holds (torch's `chunk`, as FSDP2 shards)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    per = -(-n // world) if n else 0
    start = min(rank * per, n)
    return start, min(start + per, n)


def replica_holder(rank: int, hosts: Sequence[str]) -> int | None:
    """The rank that keeps a replica of `rank`'s shard, on another host where the world has two.

    `hosts[r]` is rank r's host; ranks are contiguous per host. The rank as
    many places on as `rank`'s host has ranks (on hosts of equal size: the
    same local rank on the next host, so every rank keeps exactly one
    replica); else the next rank on another host; with a single host, the
    next rank (a process's death is still covered); with a single rank, none.
    """
    world = len(hosts)
    if world < 2:
        return None
    candidate = (rank + sum(1 for h in hosts if h == hosts[rank])) % world
    if hosts[candidate] != hosts[rank]:
        return candidate
    for step in range(1, world):
        other = (rank + step) % world
        if hosts[other] != hosts[rank]:
            return other
    return (rank + 1) % world


def wards_of(rank: int, hosts: Sequence[str]) -> list[int]:
    """The ranks whose replica `rank` keeps."""
    return [r for r in range(len(hosts)) if replica_holder(r, hosts) == rank]


class ShardLostError(RuntimeError):
    """Some rows of the committed state have no live holder: the owner and its replica are both gone."""


@dataclass(frozen=True)
class Piece:
    """Rows `[start, stop)` of tensor `tensor`, from old rank `owner`'s shard held by new rank `src`, to `dst`."""

    tensor: int
    owner: int
    src: int
    dst: int
    start: int
    stop: int
    nbytes: int

    @property
    def local(self) -> bool:
        return self.src == self.dst


@dataclass(frozen=True)
class ReshardPlan:
    """Every run of rows of the new layout, each with its one source; the same on every rank."""

    old_world: int
    new_world: int
    pieces: tuple[Piece, ...]
    minimum_bytes: int

    @property
    def bytes_moved(self) -> int:
        return sum(p.nbytes for p in self.pieces if not p.local)

    def sends(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.src == rank and not p.local]

    def receives(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.dst == rank and not p.local]

    def locals(self, rank: int) -> list[Piece]:
        return [p for p in self.pieces if p.dst == rank and p.local]


def plan_reshard(
    shapes: Sequence[Sequence[int]],
    itemsizes: Sequence[int],
    old_world: int,
    new_world: int,
    held: Mapping[int, Collection[int]],
    owned: Mapping[int, int],
) -> ReshardPlan:
    """The plan that gives every rank of `new_world` its rows of every tensor.

    `shapes[i]` is tensor i's global shape, `itemsizes[i]` its bytes per
    element. `held[r]`: the old ranks whose committed shards new rank `r`
    holds (its own and the replicas it keeps; a newcomer holds none).
    `owned[r]`: the old rank new rank `r` was, for a survivor (its own shard
    is preferred over a replica as a source). Raises `ShardLostError` when
    some rows have no holder.
    """
    if len(shapes) != len(itemsizes):
        raise ValueError(f"{len(shapes)} shapes but {len(itemsizes)} item sizes")
    holders: dict[int, list[int]] = {}
    for rank in sorted(held):
        for old in held[rank]:
            holders.setdefault(old, []).append(rank)
    owner_of = {old: new for new, old in owned.items()}
    pieces: list[Piece] = []
    minimum = 0
    for index, (shape, itemsize) in enumerate(zip(shapes, itemsizes, strict=True)):
        n = shape[0] if shape else 1
        row_bytes = itemsize
        for d in shape[1:]:
            row_bytes *= d
        for dst in range(new_world):
            start, stop = rows_of(n, new_world, dst)
            for old in range(old_world):
                lo, hi = rows_of(n, old_world, old)
                lo, hi = max(lo, start), min(hi, stop)
                if lo >= hi:
                    continue
                candidates = holders.get(old, [])
                if not candidates:
                    raise ShardLostError(
                        f"rows {lo}-{hi} of tensor {index} (shape {tuple(shape)}) were old rank {old}'s of "
                        f"{old_world}: neither its owner nor its replica is alive"
                    )
                if dst in candidates:
                    src = dst
                elif owner_of.get(old) in candidates:
                    src = owner_of[old]
                else:
                    src = candidates[0]
                nbytes = (hi - lo) * row_bytes
                if src != dst:
                    minimum += nbytes
                pieces.append(Piece(index, old, src, dst, lo, hi, nbytes))
    return ReshardPlan(old_world, new_world, tuple(pieces), minimum)
