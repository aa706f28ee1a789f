"""A sharded state's rows on the host: one flat buffer per rank and world, and moving rows between ranks by a plan.

Every sharded tensor (a parameter, an optimizer's moment) is cut on dim 0 as
`torch.chunk` cuts it (`reshard_plan.rows_of`): rank r of a world of W holds
one run of rows of each. A commit lays a rank's runs out one after the other,
in the state's order (`Layout`), as raw bytes in one flat host buffer
(`Shard_`); `Layout.offsets` finds each tensor's run in it. A reshard gives
each rank its rows of the new world (`move_rows`): for every piece of the
plan, a local copy, a send or a receive, straight between flat buffers and
the new rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ray_elastic.state.reshard_plan import ReshardPlan, rows_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.collective.base import CollectiveGroup

Key = tuple[int, str | None]  # (parameter number, optimizer state key or None for the parameter itself)


@dataclass(frozen=True)
class Layout:
    """The sharded tensors of the state, in one order on every rank: their keys, global shapes and dtypes."""

    keys: tuple[Key, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]

    @property
    def itemsizes(self) -> list[int]:
        return [d.itemsize for d in self.dtypes]

    def offsets(self, world: int, rank: int) -> list[tuple[int, int]]:
        """(byte offset, bytes) of each tensor's rows in the flat buffer of `rank` of `world`."""
        spans, at = [], 0
        for shape, size in zip(self.shapes, self.itemsizes, strict=True):
            start, stop = rows_of(shape[0], world, rank)
            nbytes = (stop - start) * size * row_numel(shape)
            spans.append((at, nbytes))
            at += nbytes
        return spans


@dataclass
class Shard_:
    """A committed shard: the flat rows of old rank `rank` of `world`, as of commit `stamp`."""

    world: int
    rank: int
    stamp: int
    flat: torch.Tensor  # uint8, on the host


def row_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[1:]:
        n *= d
    return n


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def held_as(shard: Shard_ | None) -> tuple[int, int, int] | None:
    """(world, rank, commit) of a shard whose copy is whole, for the other ranks' plans."""
    return None if shard is None or not shard.stamp else (shard.world, shard.rank, shard.stamp)


def rows_of_layout(layout: Layout, world: int, rank: int) -> list[torch.Tensor]:
    """Host tensors for `rank`'s rows of every tensor of `layout` at `world` ranks (uninitialized)."""
    out = []
    for shape, dtype in zip(layout.shapes, layout.dtypes, strict=True):
        start, stop = rows_of(shape[0], world, rank)
        out.append(torch.empty((stop - start, *shape[1:]), dtype=dtype))
    return out


def move_rows(
    ring: CollectiveGroup,
    layout: Layout,
    plan: ReshardPlan,
    source: Callable[[int], tuple[torch.Tensor, int]],
) -> list[torch.Tensor]:
    """This rank's new rows of every tensor, on the host: copied, sent and received as `plan` says.

    `source(owner)` gives the committed flat rows of old rank `owner` this
    rank holds, and the world they were cut for.

    Every send and receive is posted first and the local copies run while
    they are on the wire: a copy before a send would hold back the
    rank waiting for it.
    """
    me = ring.rank
    fresh = rows_of_layout(layout, ring.size, me)
    itemsizes = layout.itemsizes
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    works, local = [], []
    for piece in plan.pieces:
        if piece.src != me and piece.dst != me:
            continue
        shape = layout.shapes[piece.tensor]
        row = itemsizes[piece.tensor] * row_numel(shape)
        if piece.src == me:
            flat, world = source(piece.owner)
            if (world, piece.owner) not in spans:
                spans[world, piece.owner] = layout.offsets(world, piece.owner)
            at, _ = spans[world, piece.owner][piece.tensor]
            first = rows_of(shape[0], world, piece.owner)[0]
            data = flat[at + (piece.start - first) * row : at + (piece.stop - first) * row]
        if piece.dst == me:
            mine = rows_of(shape[0], ring.size, me)[0]
            into = as_bytes(fresh[piece.tensor])[(piece.start - mine) * row : (piece.stop - mine) * row]
            if piece.local:
                local.append((into, data))
            else:
                works.append(ring.recv_async(into, piece.src))
        elif piece.src == me:
            works.append(ring.send_async(data, piece.dst))
    for into, data in local:
        into.copy_(data)
    for w in works:
        w.wait()
    return fresh
