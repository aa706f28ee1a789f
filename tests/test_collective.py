"""The torch.distributed Gloo backend for real, across Ray actors.

Three `Member` actors (one process each, `num_cpus=0` so they always fit on
the shared cluster) serve the whole module, since each start imports torch.
Each test publishes a generation on its own KV actor and has the first `size`
members build `TorchGlooGroup` over that generation's store, then leave it.
Functions defined here run inside the members against their group, many
operations per remote call; their results are checked here against numpy.
The last test starts two members of its own and kills one in the middle of an
allreduce: the survivor must get `HorovodInternalError` promptly and rebuild a
ring in the same process.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import ray
import torch
from conftest import wait_until

from ray_elastic import HorovodInternalError
from ray_elastic.collective.base import Average, Max, Min, ReduceOp, Sum
from ray_elastic.rendezvous import KVClient, create_kv_actor, torch_store

# the workers cannot import this module: Ray's own cloudpickle ships its actor and functions by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.integration

DTYPES = ["float32", "float64", "int32", "int64"]
OPS = [Sum, Average, Min, Max]
KINDS = ["numpy", "torch"]
GROUP_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 120.0  # a remote call that first starts a process and imports torch


@ray.remote(num_cpus=0, max_concurrency=2)  # the second thread answers `doing` while an op blocks
class Member:
    """One worker process holding one `TorchGlooGroup` at a time."""

    def __init__(self) -> None:
        self.group = None
        self.current: str | None = None

    def join(self, kv: ray.actor.ActorHandle, generation: int, rank: int, size: int, timeout: float) -> None:
        from ray_elastic.collective.torch_gloo import TorchGlooGroup

        self.leave()  # a test that failed mid-way may have left its group behind
        self.group = TorchGlooGroup(torch_store(KVClient(kv), generation, timeout), rank, size, timeout)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.current = fn.__name__
        try:
            return fn(self.group, *args)
        finally:
            self.current = None

    def doing(self) -> str | None:
        return self.current

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


@pytest.fixture(scope="module")
def pool(cluster):
    """Three member processes shared by the module: each start imports torch (seconds on 2 cores)."""
    members = [Member.remote() for _ in range(3)]
    ray.get([m.doing.remote() for m in members], timeout=CALL_TIMEOUT_S)
    yield members
    for m in members:
        ray.kill(m)


@pytest.fixture
def kv(cluster):
    namespace = f"ray_elastic_test_coll_{uuid.uuid4().hex[:8]}"
    handle = create_kv_actor(f"run-{namespace}", namespace)
    yield handle
    ray.kill(handle)


@contextmanager
def world(kv, members: list, generation: int = 1, timeout: float = GROUP_TIMEOUT_S) -> Iterator[list]:
    """`members` joined in one group of `generation` (ranks in list order); they leave it afterwards."""
    ray.get(kv.publish.remote(generation, {"world_size": len(members)}), timeout=30)
    try:
        on_every_rank_refs(
            [m.join.remote(kv, generation, rank, len(members), timeout) for rank, m in enumerate(members)]
        )
        yield members
    finally:
        on_every_rank_refs([m.leave.remote() for m in members])


def on_every_rank_refs(refs: list) -> list[Any]:
    # let every rank finish (or fail) before raising, so no collective is left running
    ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT_S)
    return ray.get(refs, timeout=1)


def on_every_rank(members: list, fn: Callable[..., Any], *args: Any) -> list[Any]:
    return on_every_rank_refs([m.run.remote(fn, *args) for m in members])


# ---- what the members compute ------------------------------------------------------


def rank_values(rank: int, dtype: str) -> np.ndarray:
    """A 2x3 array per rank, with negative odd sums so that floor and truncation differ."""
    ints = np.array([[5 * rank - 7, 3 - 4 * rank, 11 * (rank % 2) - 2], [rank, -((rank + 1) ** 2), 2 * rank - 3]])
    values = ints + 0.25 * (rank + 1) if dtype.startswith("float") else ints
    return values.astype(dtype)


def as_kind(array: np.ndarray, kind: str):
    return torch.from_numpy(array.copy()) if kind == "torch" else array.copy()


def to_numpy(value) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else value


def reductions(group) -> dict:
    """Every allreduce variant; returns the outputs and what became of the inputs."""
    out: dict = {}
    for kind in KINDS:
        for dtype in DTYPES:
            for op in OPS:
                x = as_kind(rank_values(group.rank, dtype), kind)
                y = group.allreduce(x, op)
                z = as_kind(rank_values(group.rank, dtype), kind)
                r = group.allreduce_(z, op)
                out[kind, dtype, op.value] = {
                    "type": type(y).__name__,
                    "value": to_numpy(y).copy(),
                    "input_after_copy": to_numpy(x).copy(),
                    "same_object": r is z,
                    "input_after_inplace": to_numpy(z).copy(),
                }
    return out


def broadcasts(group) -> dict:
    """broadcast and broadcast_ from every root; returns the outputs and what became of the inputs."""
    out: dict = {}
    for kind in KINDS:
        for dtype in DTYPES:
            for root in range(group.size):
                x = as_kind(rank_values(group.rank, dtype), kind)
                y = group.broadcast(x, root)
                z = as_kind(rank_values(group.rank, dtype), kind)
                r = group.broadcast_(z, root)
                out[kind, dtype, root] = {
                    "type": type(y).__name__,
                    "value": to_numpy(y).copy(),
                    "input_after_copy": to_numpy(x).copy(),
                    "same_object": r is z,
                    "input_after_inplace": to_numpy(z).copy(),
                }
    return out


def uneven_rows(rank: int, dtype: str) -> np.ndarray:
    return (np.arange((rank + 1) * 3).reshape(rank + 1, 3) + 100 * rank).astype(dtype)


def gathers(group) -> dict:
    """allgather with rank r contributing r + 1 rows, and of 0-d, one-element and empty inputs."""
    r = group.rank
    out = {}
    for kind in KINDS:
        for dtype in ("float32", "int64"):
            out["rows", kind, dtype] = group.allgather(as_kind(uneven_rows(r, dtype), kind))
        out["0-d", kind] = group.allgather(as_kind(np.array(r + 0.5, dtype=np.float64), kind))
        out["one element", kind] = group.allgather(as_kind(np.array([10 * r], dtype=np.int32), kind))
        out["empty", kind] = group.allgather(as_kind(np.zeros((0, 3), dtype=np.float32), kind))
    return out


def gather_with_an_empty_rank(group) -> np.ndarray:
    """Rank 0 has no rows this step (its data ran out, say); rank r > 0 has r rows."""
    r = group.rank
    return group.allgather(np.full((r, 2), r, dtype=np.float32))


def objects_barrier_and_max(group, kv, generation: int) -> dict:
    r = group.rank
    out = {
        "broadcast_object": [
            group.broadcast_object({"from": r, "payload": ["x"] * (r + 1)}, root) for root in range(group.size)
        ],
        "allgather_object": group.allgather_object(("rank", r, {"tag": f"w{r}"})),
        "max_int": group.max_int(7 * r - 3),
        "max_int_negative": group.max_int(-r - 5),
    }
    # every rank records its arrival before the barrier; after it, every arrival must be visible
    client = KVClient(kv)
    client.set(generation, f"arrived/{r}", b"1")
    group.barrier()
    out["seen_after_barrier"] = client.check(generation, [f"arrived/{q}" for q in range(group.size)])
    return out


def allreduce_ones(group) -> np.ndarray:
    return group.allreduce(np.ones(4, dtype=np.float32), Sum)


# ---- what the test process expects -------------------------------------------------


def expected_reduction(size: int, dtype: str, op: ReduceOp) -> np.ndarray:
    stacked = np.stack([rank_values(r, dtype) for r in range(size)])
    total = stacked.sum(axis=0, dtype=dtype)
    if op is Sum:
        return total
    if op is Min:
        return stacked.min(axis=0)
    if op is Max:
        return stacked.max(axis=0)
    return total / size if dtype.startswith("float") else np.floor_divide(total, size)


def assert_values(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    if actual.dtype.kind == "f":
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6, err_msg=what)
    else:
        np.testing.assert_array_equal(actual, expected, err_msg=what)


TYPE_NAME = {"torch": "Tensor", "numpy": "ndarray"}

# ---- the tests ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3])
def test_allreduce_matches_numpy_and_only_the_inplace_form_writes_the_input(kv, pool, size):
    if size > 1:  # the integer data really tells floor division from truncation
        total = np.stack([rank_values(r, "int64") for r in range(size)]).sum(axis=0)
        assert (np.floor_divide(total, size) != np.trunc(total / size)).any()
    with world(kv, pool[:size]) as members:
        results = on_every_rank(members, reductions)

    for rank, out in enumerate(results):
        for (kind, dtype, op_name), got in out.items():
            what = f"allreduce {op_name} of {kind} {dtype} on rank {rank} of {size}"
            expected = expected_reduction(size, dtype, ReduceOp(op_name))
            assert got["type"] == TYPE_NAME[kind], what
            assert_values(got["value"], expected, what)
            assert_values(got["input_after_copy"], rank_values(rank, dtype), f"{what}: the input must stay untouched")
            assert got["same_object"], f"{what}: allreduce_ must return the caller's object"
            assert_values(got["input_after_inplace"], expected, f"{what}: allreduce_ must write the caller's input")
        assert len(out) == len(KINDS) * len(DTYPES) * len(OPS)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_broadcast_from_every_root_and_only_the_inplace_form_writes_the_input(kv, pool, size):
    with world(kv, pool[:size]) as members:
        results = on_every_rank(members, broadcasts)

    for rank, out in enumerate(results):
        for (kind, dtype, root), got in out.items():
            what = f"broadcast from {root} of {kind} {dtype} on rank {rank} of {size}"
            assert got["type"] == TYPE_NAME[kind], what
            assert_values(got["value"], rank_values(root, dtype), what)
            assert_values(got["input_after_copy"], rank_values(rank, dtype), f"{what}: the input must stay untouched")
            assert got["same_object"], f"{what}: broadcast_ must return the caller's object"
            assert_values(got["input_after_inplace"], rank_values(root, dtype), f"{what}: broadcast_ must write it")
        assert len(out) == len(KINDS) * len(DTYPES) * size


@pytest.mark.parametrize("size", [1, 2, 3])
def test_allgather_concatenates_in_rank_order_whatever_the_shape(kv, pool, size):
    with world(kv, pool[:size]) as members:
        results = on_every_rank(members, gathers)

    for rank, out in enumerate(results):
        for kind in KINDS:
            where = f"{kind} on rank {rank} of {size}"
            for dtype in ("float32", "int64"):
                got = out["rows", kind, dtype]
                assert type(got).__name__ == TYPE_NAME[kind], where
                expected = np.concatenate([uneven_rows(q, dtype) for q in range(size)])
                assert_values(to_numpy(got), expected, f"allgather of r + 1 rows of {dtype} {where}")
            expected_0d = np.array([q + 0.5 for q in range(size)])
            assert_values(to_numpy(out["0-d", kind]), expected_0d, f"allgather of 0-d {where}")
            expected_one = np.array([10 * q for q in range(size)], dtype=np.int32)
            assert_values(to_numpy(out["one element", kind]), expected_one, f"allgather of one element {where}")
            expected_empty = np.zeros((0, 3), dtype=np.float32)
            assert_values(to_numpy(out["empty", kind]), expected_empty, f"allgather of empty {where}")


def test_allgather_where_one_rank_has_no_rows(kv, pool):
    expected = np.concatenate([np.full((q, 2), q, dtype=np.float32) for q in range(3)])
    with world(kv, pool, timeout=5.0) as members:
        results = on_every_rank(members, gather_with_an_empty_rank)
    for rank, got in enumerate(results):
        assert_values(got, expected, f"allgather with no rows on rank 0, seen by rank {rank}")


@pytest.mark.parametrize("size", [1, 2, 3])
def test_objects_barrier_and_max_int(kv, pool, size):
    with world(kv, pool[:size], generation=1) as members:
        results = on_every_rank(members, objects_barrier_and_max, kv, 1)

    for rank, out in enumerate(results):
        where = f"on rank {rank} of {size}"
        expected_objects = [{"from": root, "payload": ["x"] * (root + 1)} for root in range(size)]
        assert out["broadcast_object"] == expected_objects, where
        assert out["allgather_object"] == [("rank", q, {"tag": f"w{q}"}) for q in range(size)], where
        assert out["max_int"] == 7 * (size - 1) - 3, where
        assert out["max_int_negative"] == -5, where
        assert out["seen_after_barrier"], f"{where}: passed the barrier before every rank arrived"


def test_a_dead_peer_raises_horovod_internal_error_and_the_survivor_rebuilds(kv):
    survivor, peer = Member.remote(), Member.remote()
    try:
        ray.get(kv.publish.remote(1, {"world_size": 2}), timeout=30)
        joins = [survivor.join.remote(kv, 1, 0, 2, 60.0), peer.join.remote(kv, 1, 1, 2, 60.0)]
        ray.get(joins, timeout=CALL_TIMEOUT_S)
        pending = survivor.run.remote(allreduce_ones)  # the peer never enters this allreduce
        wait_until(
            lambda: ray.get(survivor.doing.remote(), timeout=10) == "allreduce_ones",
            30,
            "the survivor to be inside its allreduce",
        )
        ready, _ = ray.wait([pending], timeout=0)
        assert not ready, "the allreduce finished without its peer"

        killed_at = time.monotonic()
        ray.kill(peer)
        with pytest.raises(HorovodInternalError):
            ray.get(pending, timeout=30)
        assert time.monotonic() - killed_at < 10, "a dead peer must fail the ring long before its 60 s timeout"

        # rebuilt in the same process: close, then a world of one on the next generation
        ray.get(survivor.leave.remote(), timeout=30)
        ray.get(kv.publish.remote(2, {"world_size": 1}), timeout=30)
        ray.get(survivor.join.remote(kv, 2, 0, 1, 30.0), timeout=30)
        again = ray.get(survivor.run.remote(allreduce_ones), timeout=30)
        assert_values(again, np.ones(4, dtype=np.float32), "allreduce on the rebuilt world of one")
    finally:
        ray.kill(survivor)
        ray.kill(peer)
