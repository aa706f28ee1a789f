"""One conformance suite for every collective backend this machine can run.

Backends: torch Gloo (when torch imports), pygloo (when pygloo imports: the
Python 3.10 lane, `make test-pygloo`) and NCCL (when a GPU is visible; see
the user guide's "Backends", and CONTRIBUTING.md for running it). Each is
built through `make_group`, the factory the workers use, over a real KV actor, in `Member` actors (one process
each, `num_cpus=0`) on one Ray instance: the session's cluster when another
module started it, else a plain local `ray.init`. The members are shared by the
module, and each test runs many operations per remote call.

Every op x dtype (float32, float64, int32, int64, and float16 where the backend
reduces it) x value kind (numpy, torch CPU tensors when torch imports, CUDA
tensors on NCCL) x length (empty, one element, odd, 4 MiB) x world size 1 to 4
is checked inside the members against numpy's answer for the same inputs (every
rank can compute every rank's input), so 4 MiB results need not travel back.
Then object collectives, a ring rebuilt after a member is killed mid-allreduce,
and timeouts that end in an error instead of a hang.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import ray
from conftest import wait_until

from ray_elastic import HorovodInternalError
from ray_elastic.auth import RunToken
from ray_elastic.collective.base import Average, Max, Min, ReduceOp, Sum
from ray_elastic.exceptions import RendezvousTimeoutError
from ray_elastic.rendezvous import KVClient, create_kv_actor

# the members cannot import this module: Ray's cloudpickle ships its actor and functions by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.integration

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_PYGLOO = importlib.util.find_spec("pygloo") is not None


def _gpu_count() -> int:
    if not HAS_TORCH:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _gpu_count()
BACKENDS = [
    pytest.param("gloo", marks=pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed in this venv")),
    pytest.param(
        "pygloo",
        marks=pytest.mark.skipif(
            not HAS_PYGLOO, reason="pygloo is not installed: it has wheels for Python <= 3.10 (make test-pygloo)"
        ),
    ),
    pytest.param("nccl", marks=pytest.mark.skipif(GPUS == 0, reason="no GPU on this machine (user guide: Backends)")),
]
WORLD_SIZES = [1, 2, 3, 4]
OPS = [Sum, Average, Min, Max]
DTYPES = ["float32", "float64", "int32", "int64", "float16"]  # every backend here reduces float16
FOUR_MIB = 4 * 1024 * 1024
LENGTHS = {"empty": lambda itemsize: 0, "one": lambda itemsize: 1, "odd": lambda itemsize: 1001}
LENGTHS["4MiB"] = lambda itemsize: FOUR_MIB // itemsize
GROUP_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 180.0  # a remote call that first starts a process (and imports torch) or moves 4 MiB many times


def lengths_for(kind: str) -> dict[str, Callable[[int], int]]:
    """Every length for numpy arrays and CUDA tensors; CPU tensors share numpy's path, so 4 MiB once is enough."""
    if kind == "torch":
        return {name: length for name, length in LENGTHS.items() if name != "4MiB"}
    return LENGTHS


def kinds_for(backend: str) -> list[str]:
    kinds = ["numpy"]
    if HAS_TORCH:
        kinds.append("torch")
    if backend == "nccl":
        kinds.append("cuda")
    return kinds


@ray.remote(num_cpus=0, max_concurrency=2)  # the second thread answers `doing` while an op blocks
class Member:
    """One worker process holding one group of any backend at a time."""

    def __init__(self) -> None:
        self.group = None
        self.current: str | None = None

    def join(self, backend: str, kv, generation: int, rank: int, size: int, timeout: float) -> None:
        from ray_elastic.collective.factory import load_backend, make_group

        self.leave()  # a test that failed mid-way may have left its group behind
        load_backend(backend)
        self.group = make_group(backend, KVClient(kv), generation, rank, size, timeout, local_rank=0)

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
def ray_instance():
    """The session's Ray when one is up, else a small local one for this module alone."""
    if ray.is_initialized():
        yield
        return
    # address="local": always a new instance, never another Ray already running on this machine
    ray.init(address="local", num_cpus=4, num_gpus=GPUS, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pools(ray_instance):
    """Members per backend, created on first use: 4 CPU members shared by Gloo and pygloo, one per GPU for NCCL."""
    made: dict[str, list] = {}

    def get(backend: str) -> list:
        key = "gpu" if backend == "nccl" else "cpu"
        if key not in made:
            if key == "gpu":
                if ray.cluster_resources().get("GPU", 0) < 1:
                    pytest.skip("the Ray instance shared by this session has no GPU: run this module on its own")
                members = [Member.options(num_gpus=1).remote() for _ in range(min(GPUS, 4))]
            else:
                members = [Member.remote() for _ in range(4)]
            ray.get([m.doing.remote() for m in members], timeout=CALL_TIMEOUT_S)
            made[key] = members
        return made[key]

    yield get
    for members in made.values():
        for m in members:
            ray.kill(m)


@pytest.fixture
def kv(ray_instance):
    namespace = f"ray_elastic_test_conf_{uuid.uuid4().hex[:8]}"
    handle = create_kv_actor(f"run-{namespace}", namespace, RunToken())
    yield handle
    ray.kill(handle.handle)


def members_for(pools, backend: str, size: int) -> list:
    members = pools(backend)
    if len(members) < size:
        pytest.skip(f"{backend} needs one GPU per rank: {len(members)} here, world size {size} asked")
    return members[:size]


@contextmanager
def world(kv, backend: str, members: list, generation: int = 1, timeout: float = GROUP_TIMEOUT_S) -> Iterator[list]:
    """`members` joined in one group of `generation` (ranks in list order); they leave it afterwards."""
    ray.get(kv.publish.remote(generation, {"world_size": len(members)}), timeout=30)
    try:
        on_every_rank_refs(
            [m.join.remote(backend, kv, generation, rank, len(members), timeout) for rank, m in enumerate(members)]
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


# ---- what the members compute and check --------------------------------------------


def rank_values(rank: int, dtype: str, n: int) -> np.ndarray:
    """Rank `rank`'s input: small integers (negative odd sums, so floor and truncation differ), + 0.25 k for floats.

    Every value and every sum over 4 ranks is exact in float16 too.
    """
    ints = (np.arange(n, dtype=np.int64) * 7 + 3 * rank) % 23 - 11 - rank
    values = ints + 0.25 * (rank + 1) if dtype.startswith("float") else ints
    return values.astype(dtype)


def as_kind(array: np.ndarray, kind: str):
    if kind == "numpy":
        return array.copy()
    import torch

    t = torch.from_numpy(array.copy())
    return t.cuda() if kind == "cuda" else t


def to_numpy(value) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else value.cpu().numpy()


def expected_reductions(size: int, dtype: str, n: int) -> dict[ReduceOp, np.ndarray]:
    """numpy's answer for every op over the inputs of `size` ranks."""
    stacked = np.stack([rank_values(r, dtype, n) for r in range(size)])
    total = stacked.astype(np.float64 if dtype.startswith("float") else np.int64).sum(axis=0)
    average = (total / size) if dtype.startswith("float") else np.floor_divide(total, size)
    return {
        Sum: total.astype(dtype),
        Average: average.astype(dtype),
        Min: stacked.min(axis=0),
        Max: stacked.max(axis=0),
    }


def mismatch(actual: Any, expected: np.ndarray, what: str, exact: bool = True) -> str | None:
    """None if `actual` equals `expected` (dtype, shape, values; `exact=False`: to rounding), else what differs."""
    got = to_numpy(actual)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"
    flat_got, flat_expected = got.reshape(-1), expected.reshape(-1)
    if exact or got.dtype.kind != "f":
        close = flat_got == flat_expected
    else:
        tol = 1e-3 if got.dtype == np.float16 else 1e-6
        close = np.isclose(flat_got, flat_expected, rtol=tol, atol=tol)
    if close.all():
        return None
    at = int(np.flatnonzero(~close)[0])
    return f"{what}: element {at} is {flat_got[at]}, expected {flat_expected[at]}"


def type_name(kind: str) -> str:
    return "ndarray" if kind == "numpy" else "Tensor"


def check_reductions(group) -> dict:
    """Every op x dtype x kind x length, copying and in place; returns failures and how many checks ran."""
    failures: list[str] = []
    checks = 0
    for kind in kinds_for(group.name):
        for dtype in DTYPES:
            itemsize = np.dtype(dtype).itemsize
            for length_name, length in lengths_for(kind).items():
                n = length(itemsize)
                mine = rank_values(group.rank, dtype, n)
                expected_by_op = expected_reductions(group.size, dtype, n)
                for op in OPS:
                    what = f"allreduce {op.value} {kind} {dtype} {length_name} rank {group.rank}/{group.size}"
                    expected = expected_by_op[op]
                    exact = op is not Average  # inputs and sums are exact; a quotient is rounded
                    x = as_kind(mine, kind)
                    y = group.allreduce(x, op)
                    z = as_kind(mine, kind)
                    r = group.allreduce_(z, op)
                    problems = [
                        None if type(y).__name__ == type_name(kind) else f"{what}: returned {type(y).__name__}",
                        mismatch(y, expected, what, exact),
                        mismatch(x, mine, f"{what}: the copying form wrote its input"),
                        None if r is z else f"{what}: allreduce_ did not return the caller's object",
                        mismatch(z, expected, f"{what}: allreduce_ did not write the caller's input", exact),
                    ]
                    failures += [p for p in problems if p]
                    checks += 1
    return {"failures": failures, "checks": checks}


def check_broadcasts(group) -> dict:
    """broadcast and broadcast_ from every root, every dtype x kind x length."""
    failures: list[str] = []
    checks = 0
    for kind in kinds_for(group.name):
        for dtype in DTYPES:
            for length_name, length in lengths_for(kind).items():
                n = length(np.dtype(dtype).itemsize)
                mine = rank_values(group.rank, dtype, n)
                for root in range(group.size):
                    what = f"broadcast from {root} {kind} {dtype} {length_name} rank {group.rank}/{group.size}"
                    expected = rank_values(root, dtype, n)
                    x = as_kind(mine, kind)
                    y = group.broadcast(x, root)
                    z = as_kind(mine, kind)
                    r = group.broadcast_(z, root)
                    problems = [
                        None if type(y).__name__ == type_name(kind) else f"{what}: returned {type(y).__name__}",
                        mismatch(y, expected, what),
                        mismatch(x, mine, f"{what}: the copying form wrote its input"),
                        None if r is z else f"{what}: broadcast_ did not return the caller's object",
                        mismatch(z, expected, f"{what}: broadcast_ did not write the caller's input"),
                    ]
                    failures += [p for p in problems if p]
                    checks += 1
    return {"failures": failures, "checks": checks}


def uneven_rows(rank: int, dtype: str) -> np.ndarray:
    """Rank r contributes r + 1 rows of 3 (rank 1 of 4 MiB-ish: see check_gathers)."""
    return (np.arange((rank + 1) * 3).reshape(rank + 1, 3) + 100 * rank).astype(dtype)


def check_gathers(group) -> dict:
    """allgather of every dtype x kind x length (equal lengths), of uneven rows, 0-d values and an empty rank."""
    failures: list[str] = []
    checks = 0
    size, rank = group.size, group.rank
    for kind in kinds_for(group.name):
        for dtype in DTYPES:
            for length_name, length in lengths_for(kind).items():
                n = length(np.dtype(dtype).itemsize)
                what = f"allgather {kind} {dtype} {length_name} rank {rank}/{size}"
                got = group.allgather(as_kind(rank_values(rank, dtype, n), kind))
                expected = np.concatenate([rank_values(q, dtype, n) for q in range(size)])
                failures += [p for p in [mismatch(got, expected, what)] if p]
                checks += 1
            what = f"allgather of r + 1 rows, {kind} {dtype} rank {rank}/{size}"
            got = group.allgather(as_kind(uneven_rows(rank, dtype), kind))
            expected = np.concatenate([uneven_rows(q, dtype) for q in range(size)])
            failures += [p for p in [mismatch(got, expected, what)] if p]
            if type(got).__name__ != type_name(kind):
                failures.append(f"{what}: returned {type(got).__name__}")
            checks += 1
        zero_d = group.allgather(as_kind(np.array(rank + 0.5), kind))
        failures += [p for p in [mismatch(zero_d, np.array([q + 0.5 for q in range(size)]), f"0-d {kind}")] if p]
        # rank 0 has no rows this step (its data ran out, say); rank r > 0 has r rows
        empty_rank = group.allgather(as_kind(np.full((rank, 2), rank, dtype=np.float32), kind))
        expected = np.concatenate([np.full((q, 2), q, dtype=np.float32) for q in range(size)])
        failures += [p for p in [mismatch(empty_rank, expected, f"no rows on rank 0, {kind} rank {rank}")] if p]
        checks += 2
    return {"failures": failures, "checks": checks}


def check_objects_barrier_and_max(group, kv, generation: int) -> dict:
    r = group.rank
    out = {
        "broadcast_object": [
            group.broadcast_object({"from": r, "payload": ["x"] * (r + 1), "big": b"y" * (100_000 * r)}, root)
            for root in range(group.size)
        ],
        "allgather_object": group.allgather_object(("rank", r, {"tag": f"w{r}"}, "z" * (1000 * r))),
        "max_int": group.max_int(7 * r - 3),
        "max_int_negative": group.max_int(-r - 5),
    }
    # every rank records its arrival before the barrier; after it, every arrival must be visible
    client = KVClient(kv)
    client.set(generation, f"arrived/{r}", b"1")
    group.barrier()
    out["seen_after_barrier"] = client.check(generation, [f"arrived/{q}" for q in range(group.size)])
    return out


def check_async_allreduce_and_bitwise_or(group) -> dict:
    """Two asynchronous allreduces in flight at once, waited in order, and a bitwise or of packed bitmaps."""
    failures: list[str] = []
    checks = 0
    for kind in kinds_for(group.name):
        for dtype in ("float32", "int64"):
            for length_name, length in lengths_for(kind).items():
                n = length(np.dtype(dtype).itemsize)
                mine = rank_values(group.rank, dtype, n)
                expected = expected_reductions(group.size, dtype, n)
                what = f"allreduce_async {kind} {dtype} {length_name} rank {group.rank}/{group.size}"
                summed, averaged = as_kind(mine, kind), as_kind(mine, kind)
                pending = [group.allreduce_async(summed, Sum), group.allreduce_async(averaged, Average)]
                for work in pending:
                    work.wait()
                pending[0].wait()  # a second wait is harmless (the optimizer may wait a bucket once more)
                failures += [
                    p
                    for p in (
                        mismatch(summed, expected[Sum], f"{what} sum"),
                        mismatch(averaged, expected[Average], f"{what} average", exact=False),
                    )
                    if p
                ]
                checks += 1
    # rank r sets bits r, r + size, ...: the or of all ranks is every bit of the first 8 * 37 - 3
    bits = np.zeros(8 * 37, dtype=bool)
    bits[group.rank : 8 * 37 - 3 : group.size] = True
    bitmap = np.packbits(bits)
    result = group.bitwise_or_(bitmap)
    expected_bits = np.zeros(8 * 37, dtype=bool)
    expected_bits[: 8 * 37 - 3] = True
    failures += [p for p in [mismatch(bitmap, np.packbits(expected_bits), f"bitwise_or_ rank {group.rank}")] if p]
    if result is not bitmap:
        failures.append("bitwise_or_ did not return the caller's array")
    checks += 1
    return {"failures": failures, "checks": checks}


def allreduce_ones(group) -> np.ndarray:
    return group.allreduce(np.ones(4, dtype=np.float32), Sum)


def timed_allreduce(group) -> dict:
    """An allreduce its peer never enters: how it ended, and after how long."""
    start = time.monotonic()
    try:
        group.allreduce(np.ones(4, dtype=np.float32), Sum)
        outcome = "returned"
    except HorovodInternalError as e:
        outcome = f"HorovodInternalError: {e}"
    return {"outcome": outcome, "seconds": time.monotonic() - start}


# ---- the tests ---------------------------------------------------------------------


def n_lengths(backend: str) -> int:
    """How many (kind, length) pairs a check loops over."""
    return sum(len(lengths_for(kind)) for kind in kinds_for(backend))


def assert_no_failures(results: list[dict], expected_checks: int) -> None:
    failures = [f for out in results for f in out["failures"]]
    assert not failures, f"{len(failures)} failures, first ones:\n" + "\n".join(failures[:10])
    assert [out["checks"] for out in results] == [expected_checks] * len(results), "some checks did not run"


@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_allreduce_every_op_dtype_kind_and_length(kv, pools, backend, size):
    with world(kv, backend, members_for(pools, backend, size)) as members:
        results = on_every_rank(members, check_reductions)
    assert_no_failures(results, n_lengths(backend) * len(DTYPES) * len(OPS))


@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_from_every_root(kv, pools, backend, size):
    with world(kv, backend, members_for(pools, backend, size)) as members:
        results = on_every_rank(members, check_broadcasts)
    assert_no_failures(results, n_lengths(backend) * len(DTYPES) * size)


@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_allgather_concatenates_in_rank_order(kv, pools, backend, size):
    with world(kv, backend, members_for(pools, backend, size)) as members:
        results = on_every_rank(members, check_gathers)
    kinds = len(kinds_for(backend))
    assert_no_failures(results, (n_lengths(backend) + kinds) * len(DTYPES) + 2 * kinds)


@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_async_allreduce_and_bitwise_or(kv, pools, backend, size):
    """What the torch helpers use: gradient buckets in flight together, and the sampler's bitmap union."""
    with world(kv, backend, members_for(pools, backend, size)) as members:
        results = on_every_rank(members, check_async_allreduce_and_bitwise_or)
    assert_no_failures(results, n_lengths(backend) * 2 + 1)


@pytest.mark.parametrize("size", WORLD_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_object_collectives_barrier_and_max_int(kv, pools, backend, size):
    with world(kv, backend, members_for(pools, backend, size)) as members:
        results = on_every_rank(members, check_objects_barrier_and_max, kv, 1)

    for rank, out in enumerate(results):
        where = f"on rank {rank} of {size}"
        expected_objects = [
            {"from": root, "payload": ["x"] * (root + 1), "big": b"y" * (100_000 * root)} for root in range(size)
        ]
        assert out["broadcast_object"] == expected_objects, where
        expected_gathered = [("rank", q, {"tag": f"w{q}"}, "z" * (1000 * q)) for q in range(size)]
        assert out["allgather_object"] == expected_gathered, where
        assert out["max_int"] == 7 * (size - 1) - 3, where
        assert out["max_int_negative"] == -5, where
        assert out["seen_after_barrier"], f"{where}: passed the barrier before every rank arrived"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_killed_member_fails_the_ring_and_the_survivors_rebuild_it(kv, pools, backend):
    """Three ranks; one is killed while the others wait in an allreduce it never enters."""
    members_for(pools, backend, 3)  # skips NCCL on fewer than 3 GPUs
    options = {"num_gpus": 1} if backend == "nccl" else {}
    trio = [Member.options(**options).remote() for _ in range(3)]
    survivors, victim = trio[:2], trio[2]
    try:
        ray.get(kv.publish.remote(1, {"world_size": 3}), timeout=30)
        ray.get([m.join.remote(backend, kv, 1, r, 3, 60.0) for r, m in enumerate(trio)], timeout=CALL_TIMEOUT_S)
        pending = [m.run.remote(allreduce_ones) for m in survivors]
        if backend != "pygloo":  # a blocked pygloo call holds its process's GIL: `doing` cannot answer
            wait_until(
                lambda: ray.get([m.doing.remote() for m in survivors], timeout=10) == ["allreduce_ones"] * 2,
                30,
                "both survivors to be inside their allreduce",
            )
        ready, _ = ray.wait(pending, timeout=0.5)
        assert not ready, "the allreduce finished without its third rank"

        killed_at = time.monotonic()
        ray.kill(victim)
        for ref in pending:
            with pytest.raises(HorovodInternalError):
                ray.get(ref, timeout=60)
        assert time.monotonic() - killed_at < 10, "a dead peer must fail the ring long before its 60 s timeout"

        # rebuilt in the same processes: leave, then a world of two on the next generation
        ray.get([m.leave.remote() for m in survivors], timeout=30)
        ray.get(kv.publish.remote(2, {"world_size": 2}), timeout=30)
        ray.get([m.join.remote(backend, kv, 2, r, 2, 30.0) for r, m in enumerate(survivors)], timeout=60)
        again = ray.get([m.run.remote(allreduce_ones) for m in survivors], timeout=60)
        for got in again:
            np.testing.assert_array_equal(got, np.full(4, 2, dtype=np.float32))
    finally:
        for m in trio:
            ray.kill(m)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_that_never_joins_is_a_rendezvous_error_not_a_hang(kv, pools, backend):
    lone = members_for(pools, backend, 2)[0]
    ray.get(kv.publish.remote(1, {"world_size": 2}), timeout=30)
    start = time.monotonic()
    with pytest.raises((HorovodInternalError, RendezvousTimeoutError)) as info:
        ray.get(lone.join.remote(backend, kv, 1, 0, 2, 2.0), timeout=60)
    waited = time.monotonic() - start
    assert 1.5 < waited < 30, f"forming a ring with a missing peer ended after {waited:.1f} s, timeout 2 s"
    assert "time" in str(info.value).lower(), str(info.value)
    ray.get(lone.leave.remote(), timeout=30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_collective_its_peer_never_enters_times_out(kv, pools, backend):
    """The peer is alive and connected but busy elsewhere: the collective's timeout ends the wait."""
    pair = members_for(pools, backend, 2)
    timeout = 3.0
    bound = timeout
    if backend == "pygloo":
        from ray_elastic.collective.pygloo_backend import GLOO_FIXED_TIMEOUT_S

        bound = GLOO_FIXED_TIMEOUT_S  # pygloo 0.2.1 cannot set Gloo's timeout from Python
    with world(kv, backend, pair, timeout=timeout):
        got = ray.get(pair[0].run.remote(timed_allreduce), timeout=bound + 60)
    assert got["outcome"].startswith("HorovodInternalError"), got
    assert bound * 0.5 < got["seconds"] < bound + 15, f"timed out after {got['seconds']:.1f} s, bound {bound} s"
