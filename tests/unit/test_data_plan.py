"""Who takes which rows of a Ray Dataset's epoch (`ray_elastic/data/plan.py`): pure arithmetic, no Ray.

The promise these hold the arithmetic to: whatever the world does between
steps (a rollback to a committed position, a resize, a newcomer), every
row of the epoch is trained exactly once, except the padding of the last
step (counted). (`drop_last`, which skips a short last step whole, is the
shard's: tests/unit/test_data_batches.py.)
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_elastic.data.plan import BlockTable, EpochOrder, step_rows


def rows_of(step) -> list[int]:
    return [p for a, b in step.ranges for p in range(a, b)]


def one_step(position, total, size, batch_size):
    """Every rank's rows of one step (and the step), as the ranks compute them alone."""
    steps = [step_rows(position, total, total, r, size, batch_size) for r in range(size)]
    if steps[0] is None:
        return None, None
    assert len({(s.next_position, s.padding_rows, s.dropped_rows) for s in steps}) == 1, "ranks disagree"
    return [rows_of(s) for s in steps], steps[0]


def test_a_full_step_gives_each_rank_its_slice_in_rank_order():
    rows, step = one_step(position=10, total=100, size=3, batch_size=4)
    assert rows == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21]]
    assert step.next_position == 22 and step.padding_rows == 0


def test_the_last_step_pads_with_its_own_rows_and_counts_them():
    # 5 rows left for 3 ranks of batch 4: each gets ceil(5/3) = 2 rows, one of them a repeat
    rows, step = one_step(position=95, total=100, size=3, batch_size=4)
    assert rows == [[95, 96], [97, 98], [99, 95]]
    assert step.next_position == 100 and step.padding_rows == 1
    assert one_step(100, 100, 3, 4) == (None, None)


def test_an_unknown_length_asks_for_the_rows_a_full_step_needs():
    with pytest.raises(LookupError) as need:
        step_rows(position=8, known=10, total=None, rank=0, size=2, batch_size=4)
    assert need.value.args == (16,)
    assert rows_of(step_rows(8, 16, None, 1, 2, 4)) == [12, 13, 14, 15]


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(1, 400),
    batch_size=st.integers(1, 17),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=40),
    rollbacks=st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_every_row_once_through_resizes_and_rollbacks(total, batch_size, sizes, rollbacks):
    """A world that changes size at every step and sometimes rolls back to its last commit."""
    trained: collections.Counter = collections.Counter()  # rows trained and kept (committed or final)
    pending: collections.Counter = collections.Counter()  # trained since the last commit
    position = committed = padding = dropped = 0
    committed_padding = committed_dropped = 0
    for i in range(10_000):
        size = sizes[i % len(sizes)]
        rows, step = one_step(position, total, size, batch_size)
        if step is None:
            break
        for r in rows:
            pending.update(r)
        position, padding, dropped = step.next_position, padding + step.padding_rows, dropped + step.dropped_rows
        if rollbacks[i % len(rollbacks)]:  # a failure: back to the commit, what was trained since is undone
            position, padding, dropped = committed, committed_padding, committed_dropped
            pending.clear()
        else:  # a commit
            trained.update(pending)
            pending.clear()
            committed, committed_padding, committed_dropped = position, padding, dropped
    trained.update(pending)
    assert position == total
    assert sum(trained.values()) == total - dropped + padding
    assert all(trained[p] >= 1 for p in range(total - dropped)), "a row was never trained"
    assert sum(c - 1 for c in trained.values() if c > 1) == padding, "a repeat that is not counted as padding"


def test_block_table_maps_positions_to_pieces_of_blocks():
    table = BlockTable()
    for rows in (5, 0, 3, 7):
        table.add(rows)
    assert table.known == 15
    assert table.pieces(3, 10) == [(0, 3, 5), (2, 0, 3), (3, 0, 2)]
    assert table.block_of(0) == 0 and table.block_of(5) == 2 and table.block_of(14) == 3 and table.block_of(15) == 4
    with pytest.raises(IndexError, match="outside the 15 known rows"):
        table.pieces(10, 16)


def table_of(*rows: int) -> BlockTable:
    table = BlockTable()
    for n in rows:
        table.add(n)
    return table


def served(order: EpochOrder, start: int, end: int) -> list[tuple[int, int]]:
    return [(index, int(r)) for index, rows in order.rows(start, end) for r in rows]


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_epochs_order_serves_every_row_of_every_block_once(shuffle):
    table = table_of(5, 0, 3, 7, 4, 6)
    order = EpochOrder(table, seed=1, epoch=2, shuffle=shuffle, window=4)
    # served in odd pieces, as batches of changing world sizes would take them
    cuts = [0, 3, 4, 11, 12, 20, 25]
    pieces = [p for a, b in zip(cuts, cuts[1:], strict=False) for p in served(order, a, b)]
    assert sorted(pieces) == sorted((i, r) for i, n in enumerate(table.rows) for r in range(n))


def test_shuffling_mixes_rows_across_the_blocks_of_a_window_and_is_replayable():
    table = table_of(100, 100, 100, 100, 100)
    order = EpochOrder(table, seed=1, epoch=2, shuffle=True, window=4)
    first_batch = served(order, 0, 40)
    assert len({index for index, _ in first_batch}) >= 3, "a batch draws on the window's blocks, not one block"
    assert all(index < 4 for index, _ in first_batch), "the first window's blocks only"
    again = EpochOrder(table, seed=1, epoch=2, shuffle=True, window=4)
    assert served(again, 0, 40) == first_batch, "the same on every rank and after every reset"
    other = EpochOrder(table, seed=1, epoch=3, shuffle=True, window=4)
    assert served(other, 0, 40) != first_batch, "a new order each epoch"
    assert served(EpochOrder(table, 1, 2, False), 0, 3) == [(0, 0), (0, 1), (0, 2)]


def test_a_window_is_served_only_once_all_its_blocks_are_known():
    table = table_of(10, 10, 10, 10, 10, 10)  # one whole window of 4 blocks, and 2 of the next
    order = EpochOrder(table, seed=0, epoch=0, shuffle=True, window=4)
    assert order.usable(ended=False) == 40
    assert order.usable(ended=True) == 60, "the stream ended: the last window is whole as it is"
    assert EpochOrder(table, 0, 0, shuffle=False).usable(ended=False) == 60


def test_datasets_without_ray_data_installed_name_the_extra(monkeypatch):
    import sys

    from ray_elastic.data import check_datasets

    monkeypatch.setitem(sys.modules, "ray.data", None)  # as in an install without the extra
    with pytest.raises(ImportError, match=r"pip install 'ray\[data\]==2.60.\*' \(the 'data' extra of ray-elastic\)"):
        check_datasets({"train": object()})
    assert check_datasets(None) == {}, "no datasets: Ray Data is not needed"
