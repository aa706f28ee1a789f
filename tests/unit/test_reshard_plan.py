"""The reshard planner, pure: every byte of the new layout from exactly one live holder, and no more bytes than needed.

Checked row by row against a direct computation (no shared code with the
planner but torch's chunk rule, which FSDP2 itself follows), over random
global shapes, old and new worlds of 1 to 64 ranks, hosts, and losses.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_elastic.state.reshard_plan import ShardLostError, plan_reshard, replica_holder, rows_of, wards_of


def chunk_rows(n: int, world: int) -> list[range]:
    """Each rank's rows of an n-row tensor, as torch.chunk (FSDP2's rule) cuts them."""
    chunks = torch.arange(n).chunk(world) if n else ()
    out = [range(int(c[0]), int(c[-1]) + 1) if c.numel() else range(0) for c in chunks]
    return out + [range(0)] * (world - len(out))


@st.composite
def scenarios(draw):
    old_world = draw(st.integers(1, 64))
    per_host = draw(st.integers(1, 8))
    hosts = [f"h{r // per_host}" for r in range(old_world)]
    shapes = draw(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 5)), min_size=1, max_size=4))
    itemsizes = draw(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=len(shapes), max_size=len(shapes)))
    # one host lost (or none), the survivors first in the new ranks, then newcomers
    lost_host = draw(st.sampled_from([None, *sorted(set(hosts))])) if len(set(hosts)) > 1 else None
    survivors = [r for r in range(old_world) if hosts[r] != lost_host]
    survivors = draw(st.permutations(survivors)) if draw(st.booleans()) else survivors
    newcomers = draw(st.integers(0 if survivors else 1, 8))
    new_world = len(survivors) + newcomers
    return shapes, itemsizes, old_world, hosts, survivors, new_world


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_every_new_row_comes_from_one_live_holder_and_only_missing_rows_move(case) -> None:
    shapes, itemsizes, old_world, hosts, survivors, new_world = case
    holder_of = {r: replica_holder(r, hosts) for r in range(old_world)}
    held = {new: {old, *wards_of(old, hosts)} for new, old in enumerate(survivors)}
    owned = dict(enumerate(survivors))
    plan = plan_reshard(shapes, itemsizes, old_world, new_world, held, owned)

    minimum = 0
    for t, (shape, size) in enumerate(zip(shapes, itemsizes, strict=True)):
        row = size
        for d in shape[1:]:
            row *= d
        old_rows = chunk_rows(shape[0], old_world)
        for dst, rows in enumerate(chunk_rows(shape[0], new_world)):
            covered: list[int] = []
            for piece in (p for p in plan.pieces if p.tensor == t and p.dst == dst):
                assert piece.owner in held.get(piece.src, ()), "a piece comes from a rank that does not hold it"
                assert set(range(piece.start, piece.stop)) <= set(old_rows[piece.owner])
                assert piece.nbytes == (piece.stop - piece.start) * row
                covered.extend(range(piece.start, piece.stop))
            assert sorted(covered) == list(rows), "the new rows are not covered exactly once"
            mine = {i for old in held.get(dst, ()) for i in old_rows[old]}
            minimum += sum(row for i in rows if i not in mine)
    assert plan.bytes_moved == plan.minimum_bytes == minimum
    # one host lost: every old shard still had a holder (the replica is on another host where there is one)
    if len(set(hosts)) > 1:
        assert all(hosts[holder_of[r]] != hosts[r] for r in range(old_world))


def test_a_shard_and_its_replica_both_lost_is_named() -> None:
    hosts = ["a", "a", "b", "b"]
    # old ranks 1 and 3 hold each other's replicas: losing both loses rows
    assert replica_holder(1, hosts) == 3 and replica_holder(3, hosts) == 1
    held = {0: {0, 2}, 1: {2, 0}}
    with pytest.raises(ShardLostError, match="old rank 1.s of 4"):
        plan_reshard([(8, 2)], [4], 4, 2, held, {0: 0, 1: 2})


def test_rows_follow_torch_chunk_with_empty_ranks() -> None:
    assert [rows_of(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert [rows_of(0, 3, r) for r in range(3)] == [(0, 0)] * 3


def test_replicas_on_equal_hosts_form_a_permutation_across_hosts() -> None:
    hosts = ["a", "a", "b", "b", "c", "c"]
    holders = [replica_holder(r, hosts) for r in range(6)]
    assert sorted(holders) == list(range(6))
    assert all(hosts[h] != hosts[r] for r, h in enumerate(holders))
    assert replica_holder(0, ["a"]) is None
    assert [replica_holder(r, ["a"] * 3) for r in range(3)] == [1, 2, 0]
