"""The checks of the user-level collectives, without Ray: each rank's own arguments, and the cross-rank
agreement on a ring of threads (`ThreadRing`: one thread per rank, numpy only, so this runs in the pygloo
lane too). The same checks on real backends and through `fit()`: tests/integration/test_backends_cluster.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ray_elastic.collective import checked
from ray_elastic.collective.base import Average, CollectiveGroup, Max, Min, ReduceOp, Sum
from ray_elastic.collective.checked import Signature, mismatch_message
from ray_elastic.exceptions import CollectiveMismatchError


class Hub:
    """What the threads of one ring share: a slot per rank, a barrier, and a log of the collectives run."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list[Any] = [None] * size
        self.calls: list[str] = []  # rank 0's collectives, in order

    def exchange(self, rank: int, what: str, item: Any) -> list[Any]:
        if rank == 0:
            self.calls.append(what)
        self.slots[rank] = item
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()
        return items


class ThreadRing(CollectiveGroup):
    """A ring whose ranks are threads of this process: what a real backend computes, in numpy.

    Like Gloo it reduces whatever each rank hands in; arrays that do not match make numpy raise here
    (the real backends return garbage or abort), so a test that passes never reached a mismatched op.
    """

    name = "threads"

    def __init__(self, hub: Hub, rank: int, size: int) -> None:
        super().__init__(rank, size)
        self.hub = hub

    def allreduce_(self, value: Any, op: ReduceOp = Average) -> Any:
        stacked = np.stack(self.hub.exchange(self.rank, f"allreduce {value.dtype}{value.shape}", value.copy()))
        if op is Min:
            out = stacked.min(axis=0)
        elif op is Max:
            out = stacked.max(axis=0)
        else:
            out = stacked.sum(axis=0)
            if op is Average:
                out = out / self.size if value.dtype.kind == "f" else out // self.size
        np.copyto(value, out, casting="unsafe")
        return value

    def broadcast_(self, value: Any, root_rank: int = 0) -> Any:
        np.copyto(value, self.hub.exchange(self.rank, "broadcast", value.copy())[root_rank])
        return value

    def allgather(self, value: Any) -> Any:
        parts = self.hub.exchange(self.rank, "allgather", value.reshape(-1) if value.ndim == 0 else value)
        return np.concatenate(parts)

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return self.hub.exchange(self.rank, "broadcast_object", obj)[root_rank]

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.hub.exchange(self.rank, "allgather_object", obj)

    def barrier(self) -> None:
        self.hub.exchange(self.rank, "barrier", None)

    def close(self) -> None:
        pass


def on_ranks(size: int, fn: Callable[[ThreadRing], Any]) -> tuple[list[Any], Hub]:
    """Run `fn(ring)` on `size` thread ranks; each rank's return value, or the exception it raised."""
    hub = Hub(size)
    out: list[Any] = [None] * size

    def one(rank: int) -> None:
        try:
            out[rank] = fn(ThreadRing(hub, rank, size))
        except Exception as e:  # noqa: BLE001 - the test looks at what each rank raised
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    return out, hub


def mismatch_on_every_rank(results: list[Any]) -> str:
    """The one message every rank raised `CollectiveMismatchError` with."""
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    messages = {str(r) for r in results}
    assert len(messages) == 1, messages
    return messages.pop()


# ---- mismatches, raised on every rank before any data moves ---------------------------------


def test_mismatched_dtypes_raise_on_every_rank_naming_each():
    arrays = [np.ones(4, np.float32), np.ones(4, np.int32)]
    results, hub = on_ranks(2, lambda ring: checked.allreduce(ring, arrays[ring.rank], Sum))
    message = mismatch_on_every_rank(results)
    assert message.startswith("Mismatched allreduce data types: rank 0 (4,) float32, rank 1 (4,) int32. ")
    assert hub.calls == ["allreduce int64(2,)", "allgather_object"]  # the vote, then the names; no data op


def test_mismatched_shapes_and_sizes_are_named_like_horovod():
    shapes = [(2, 3), (3, 2)]
    results, _ = on_ranks(2, lambda ring: checked.allreduce_(ring, np.zeros(shapes[ring.rank], np.float32), Sum))
    assert mismatch_on_every_rank(results).startswith(
        "Mismatched allreduce tensor shapes: rank 0 (2, 3) float32, rank 1 (3, 2) float32"
    )
    results, _ = on_ranks(2, lambda ring: checked.allreduce(ring, np.zeros(4 * (ring.rank + 1)), Average))
    assert mismatch_on_every_rank(results).startswith(
        "Mismatched allreduce tensor shapes: rank 0 (4,) float64, rank 1 (8,) float64"
    )


def test_mismatched_ops_roots_and_collectives():
    ops = ["sum", "max"]
    results, _ = on_ranks(2, lambda ring: checked.allreduce(ring, np.zeros(3), ops[ring.rank]))
    assert mismatch_on_every_rank(results).startswith(
        "Mismatched allreduce reduce ops: rank 0 (3,) float64 op sum, rank 1 (3,) float64 op max"
    )

    results, _ = on_ranks(2, lambda ring: checked.broadcast_(ring, np.zeros(3), ring.rank))
    assert mismatch_on_every_rank(results).startswith(
        "Mismatched broadcast root ranks: rank 0 (3,) float64 root 0, rank 1 (3,) float64 root 1"
    )

    def different_calls(ring: ThreadRing) -> Any:
        if ring.rank == 0:
            return checked.allreduce(ring, np.zeros(3), Sum)
        return checked.broadcast(ring, np.zeros(3), 0)

    results, _ = on_ranks(2, different_calls)
    assert mismatch_on_every_rank(results).startswith(
        "Mismatched collective operations: rank 0 allreduce (3,) float64 op sum, rank 1 broadcast (3,) float64 root 0"
    )


def test_allgather_rows_may_differ_but_not_the_rest_of_the_shape():
    results, _ = on_ranks(2, lambda ring: checked.allgather(ring, np.full((ring.rank + 1, 2), ring.rank)))
    np.testing.assert_array_equal(results[0], [[0, 0], [1, 1], [1, 1]])
    np.testing.assert_array_equal(results[1], results[0])

    results, _ = on_ranks(2, lambda ring: checked.allgather(ring, np.zeros((5, 3 + ring.rank), np.float32)))
    assert mismatch_on_every_rank(results).startswith(
        "Mismatched allgather tensor shapes (all but the first dimension must match): "
        "rank 0 (5, 3) float32, rank 1 (5, 4) float32"
    )


def test_ranks_with_the_same_arguments_are_listed_together():
    results, _ = on_ranks(5, lambda ring: checked.allreduce(ring, np.zeros(2 if ring.rank == 3 else 1), Sum))
    assert mismatch_on_every_rank(results).startswith(
        "Mismatched allreduce tensor shapes: ranks 0-2, 4 (1,) float64, rank 3 (2,) float64"
    )


def test_a_big_world_of_different_shapes_lists_a_few():
    message = mismatch_message([Signature("allreduce", "float32", (r,), "sum") for r in range(64)])
    assert message.startswith("Mismatched allreduce tensor shapes: rank 0 (0,) float32, rank 1 (1,) float32, ")
    assert "rank 7 (7,) float32, and 56 more. Every rank" in message


def test_the_ring_still_works_after_a_mismatch():
    def run(ring: ThreadRing) -> Any:
        with pytest.raises(CollectiveMismatchError):
            checked.allreduce(ring, np.zeros(ring.rank + 1), Sum)
        return checked.allreduce(ring, np.full(3, ring.rank + 1.0), Sum)

    results, _ = on_ranks(2, run)
    for r in results:
        np.testing.assert_array_equal(r, [3.0, 3.0, 3.0])


# ---- what a matching call costs, and turning the agreement off ---------------------------------


def test_a_matching_call_costs_one_tiny_allreduce_and_none_alone_or_when_turned_off():
    results, hub = on_ranks(2, lambda ring: checked.allreduce(ring, np.full(4, ring.rank, np.float32), Sum))
    assert hub.calls == ["allreduce int64(2,)", "allreduce float32(4,)"]
    np.testing.assert_array_equal(results[0], [1, 1, 1, 1])

    results, hub = on_ranks(1, lambda ring: checked.allreduce(ring, np.ones(4), Sum))
    assert hub.calls == ["allreduce float64(4,)"]

    checked.set_argument_checks(False)
    try:
        assert not checked.argument_checks_enabled()
        results, hub = on_ranks(2, lambda ring: checked.broadcast(ring, np.full(4, ring.rank), 1))
    finally:
        checked.set_argument_checks(True)
    assert hub.calls == ["broadcast"]
    np.testing.assert_array_equal(results[0], [1, 1, 1, 1])


@pytest.mark.parametrize(
    "text, on", [(None, True), ("1", True), ("yes", True), ("0", False), (" False ", False), ("off", False)]
)
def test_the_environment_variable_turns_the_agreement_off(text, on):
    assert checked.enabled_by_env(text) is on


def test_the_library_s_own_hot_paths_are_not_checked():
    """The ring's own methods (the gradient buckets' allreduce_async, bitwise_or_, max_int) add no vote."""

    def run(ring: ThreadRing) -> Any:
        ring.allreduce_async(np.ones(4), Sum).wait()
        ring.bitwise_or_(np.array([1 << ring.rank], np.uint8))
        return ring.max_int(ring.rank)

    results, hub = on_ranks(2, run)
    assert results == [1, 1]
    assert "allreduce int64(2,)" not in hub.calls


# ---- numbers ----------------------------------------------------------------------------------


def test_python_and_numpy_numbers_come_back_as_the_same_type():
    results, _ = on_ranks(2, lambda ring: checked.allreduce(ring, 3.0 * (ring.rank + 1), "sum"))
    assert results == [9.0, 9.0] and all(type(r) is float for r in results)

    results, _ = on_ranks(2, lambda ring: checked.allreduce(ring, 2 + ring.rank, Average))
    assert results == [2, 2] and all(type(r) is int for r in results)  # floor, as on integer arrays

    results, _ = on_ranks(2, lambda ring: checked.allreduce(ring, np.float32(ring.rank + 0.5), "MAX"))
    assert results == [1.5, 1.5] and all(type(r) is np.float32 for r in results)

    results, _ = on_ranks(2, lambda ring: checked.broadcast(ring, 10 + ring.rank, 1))
    assert results == [11, 11] and all(type(r) is int for r in results)


def test_an_int_on_one_rank_and_a_float_on_another_is_a_mismatch():
    results, _ = on_ranks(2, lambda ring: checked.allreduce(ring, 0 if ring.rank else 0.5, Sum))
    assert mismatch_on_every_rank(results).startswith(
        "Mismatched allreduce data types: rank 0 () float64, rank 1 () int64"
    )


def test_values_that_are_not_tensors_arrays_or_numbers_are_refused_at_once():
    ring = ThreadRing(Hub(2), 0, 2)  # a lone rank of two: any collective it started would wait for its peer
    with pytest.raises(TypeError, match=r"allreduce takes a torch tensor, a numpy array, or a Python or numpy number"):
        checked.allreduce(ring, [1.0, 2.0], Sum)
    with pytest.raises(TypeError, match=r"not a bool: pass int\(flag\)"):
        checked.allreduce(ring, True, Max)
    with pytest.raises(TypeError, match=r"allreduce_ takes a torch tensor or a numpy array, got float; allreduce"):
        checked.allreduce_(ring, 3.0, Sum)
    with pytest.raises(TypeError, match=r"broadcast_ takes a torch tensor or a numpy array, got int; broadcast"):
        checked.broadcast_(ring, 3, 0)
    with pytest.raises(
        TypeError, match="allgather takes a torch tensor or a numpy array, got float; .* allgather_object"
    ):
        checked.allgather(ring, 1.0)
    assert ring.hub.calls == []


# ---- ops and root ranks -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, op",
    [("sum", Sum), ("SUM", Sum), ("Average", Average), ("avg", Average), ("min", Min), (" max", Max), (Max, Max)],
)
def test_ops_by_name_in_any_case(given, op):
    assert checked.reduce_op(given) is op


def test_unknown_ops_are_refused_listing_the_known_ones():
    with pytest.raises(
        ValueError, match=r"unknown reduce op 'mean': use ray_elastic.Sum, Average, Min, Max, or one of 'sum'"
    ):
        checked.reduce_op("mean")
    with pytest.raises(TypeError, match="op must be a ReduceOp or its name, got int"):
        checked.reduce_op(0)
    ring = ThreadRing(Hub(2), 0, 2)
    with pytest.raises(ValueError, match="unknown reduce op 'prod'"):
        checked.allreduce(ring, np.ones(2), "prod")
    assert ring.hub.calls == []


def test_root_ranks_must_be_ranks_of_this_world():
    assert checked.root_rank_in(np.int64(1), 2) == 1
    with pytest.raises(ValueError, match=r"root_rank=2 is not a rank of this world of size 2 \(ranks 0..1\)"):
        checked.root_rank_in(2, 2)
    with pytest.raises(ValueError, match="root_rank=-1"):
        checked.root_rank_in(-1, 2)
    for wrong in ("0", 0.0, True):
        with pytest.raises(TypeError, match="root_rank must be an int"):
            checked.root_rank_in(wrong, 2)
    ring = ThreadRing(Hub(2), 0, 2)
    with pytest.raises(ValueError, match="root_rank=5"):
        checked.broadcast(ring, np.ones(2), 5)
    assert ring.hub.calls == []


# ---- signatures -------------------------------------------------------------------------------


def test_signatures_match_across_numpy_and_torch_and_differ_otherwise():
    a = Signature.of("allreduce", np.zeros((2, 3), np.float32), op=Sum)
    assert a == Signature("allreduce", "float32", (2, 3), "sum")
    assert a.fingerprint() == Signature("allreduce", "float32", (2, 3), "sum").fingerprint()
    assert 0 <= a.fingerprint() < 2**63
    others = [
        Signature("allreduce", "float32", (3, 2), "sum"),
        Signature("allreduce", "float64", (2, 3), "sum"),
        Signature("allreduce", "float32", (2, 3), "average"),
        Signature("broadcast", "float32", (2, 3), root_rank=0),
    ]
    assert len({a.fingerprint(), *(o.fingerprint() for o in others)}) == 5
    # allgather: only the rows may differ, and a 0-d value is one row
    assert Signature.of("allgather", np.zeros((5, 3))).key() == Signature.of("allgather", np.zeros((1, 3))).key()
    assert Signature.of("allgather", np.zeros(())).key() == Signature.of("allgather", np.zeros(4)).key()

    torch = pytest.importorskip("torch")
    assert Signature.of("allreduce", torch.zeros(2, 3), op=Sum) == a
