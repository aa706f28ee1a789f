"""The GPU path's decisions, without a GPU: which backend a ring of GPU workers runs, which GPU a worker drives,
and what the driver says when a ring fails the same way generation after generation.

- `collective/devices.plan_backend` gets the GPU ids Ray gave each rank:
  two ranks on one GPU turn `backend="auto"` into torch Gloo (with a reason
  to log) and make `backend="nccl"` fail before any ring forms, naming the
  workers, the GPU and NCCL's rule.
- `collective/devices.device_index`: the GPU Ray gave the worker, not its
  local rank.
- `driver/core/policies.judge_ring_failure` and the driver core: an error that
  repeats in consecutive generations is quoted with its rank; "deadlock" is
  said only of collectives that timed out.
"""

from __future__ import annotations

import pytest

from ray_elastic.collective.devices import GpuSeat, device_index, plan_backend, shared_gpus
from ray_elastic.config import RunConfig
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.driver_core import DriverCore
from ray_elastic.driver.core.policies import Ring, RingError, judge_ring_failure
from ray_elastic.exceptions import DeviceConflictError
from ray_elastic.protocol import DriverState

NODE = "a1b2c3d4e5f6a7b8c9d0"


def seats(*gpus: tuple[str, ...], node: str = NODE) -> dict[int, GpuSeat]:
    return {rank: GpuSeat(f"w{rank + 1}", node, ids) for rank, ids in enumerate(gpus)}


def test_ranks_on_their_own_gpus_keep_nccl():
    assert plan_backend("nccl", "auto", seats(("0",), ("1",))).backend == "nccl"
    assert plan_backend("nccl", "nccl", seats(("0",), ("1",))).reason == ""
    # the same GPU id on two nodes is two GPUs
    two_nodes = {0: GpuSeat("w1", "node-a", ("0",)), 1: GpuSeat("w2", "node-b", ("0",))}
    assert plan_backend("nccl", "auto", two_nodes).backend == "nccl"


def test_auto_with_two_ranks_on_one_gpu_runs_gloo_and_says_why():
    plan = plan_backend("nccl", "auto", seats(("0",), ("0",)))
    assert plan.backend == "gloo"
    assert "w1 (rank 0), w2 (rank 1) share GPU 0 of node a1b2c3d4e5f6" in plan.reason
    assert "NCCL allows one rank per GPU" in plan.reason


def test_nccl_asked_for_with_two_ranks_on_one_gpu_fails_naming_workers_gpu_and_rule():
    with pytest.raises(DeviceConflictError) as e:
        plan_backend("nccl", "nccl", seats(("1",), ("0",), ("1",)))
    text = str(e.value)
    assert "w1 (rank 0), w3 (rank 2) share GPU 1 of node a1b2c3d4e5f6" in text
    assert "NCCL allows one rank per GPU" in text
    assert "w2" not in text


def test_cpu_backends_are_not_re_planned():
    assert plan_backend("gloo", "gloo", seats(("0",), ("0",))).backend == "gloo"


def test_shared_gpus_lists_every_shared_gpu_once_per_rank():
    assert shared_gpus(seats(("0", "0"), ("1",))) == {}
    assert shared_gpus(seats(("0", "1"), ("1",), ("0",))) == {(NODE, "0"): [0, 2], (NODE, "1"): [0, 1]}


def test_seats_travel_through_the_kv_store_as_json():
    seat = GpuSeat("w7", NODE, ("3",))
    assert GpuSeat.decode(seat.encode()) == seat


def test_the_worker_drives_the_gpu_ray_gave_it_not_its_local_rank():
    # Ray narrowed CUDA_VISIBLE_DEVICES to the worker's GPU: it is cuda:0 whatever the local rank
    assert device_index(["3"], "3", local_rank=1, count=1) == 0
    # several visible: the index of Ray's GPU among them
    assert device_index(["5"], "4,5,6", local_rank=0, count=3) == 1
    # Ray left CUDA_VISIBLE_DEVICES alone (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): the id is the index
    assert device_index(["2"], None, local_rank=0, count=4) == 2
    # no GPU from Ray (a process outside a Ray GPU actor): by local rank
    assert device_index([], None, local_rank=3, count=2) == 1
    with pytest.raises(ValueError):
        device_index([], None, local_rank=0, count=0)


BUSY = {"idle_s": 0.2, "in_collective": False}
BAD_ADDRESS = "send to rank 1 failed: [gloo/transport/tcp/pair.cc:339] writev 10.0.0.2:{port}: Bad address"
RESET = "receive from rank 0 failed: [gloo/transport/tcp/pair.cc:598] Connection reset by peer"


def judge(errors, previous, last=50.0):
    return judge_ring_failure(
        {"w1": BUSY, "w2": BUSY},
        collective_timeout=20.0,
        liveness_timeout=5.0,
        last_timeout_reset=last,
        now=60.0,
        errors=errors,
        previous_errors=previous,
    )


def test_a_repeated_error_is_quoted_with_the_rank_that_raised_it_and_no_deadlock_is_claimed():
    before = [RingError(0, "w1", BAD_ADDRESS.format(port=41213)), RingError(1, "w2", RESET)]
    now = [RingError(0, "w1", BAD_ADDRESS.format(port=39001)), RingError(1, "w2", RESET)]
    verdict = judge(now, before)
    assert verdict.verdict is Ring.FAIL
    assert "same error in two generations in a row" in verdict.reason
    # the cause, not its echo on the peer: rank 0's error, quoted
    assert "rank 0 (w1) raised: 'send to rank 1 failed:" in verdict.reason and "Bad address" in verdict.reason
    assert "deadlock" not in verdict.reason
    # the first failure re-forms the ring, whatever the error
    assert judge(now, [], last=None).verdict is Ring.REFORM


def test_only_timeouts_are_called_a_deadlock():
    timed_out = [RingError(0, "w1", "allreduce did not finish within collective_timeout=20 s")]
    assert "deadlock" in judge(timed_out, timed_out).reason
    nccl = "allreduce failed: ncclInvalidUsage: Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1a000"
    differs = judge([RingError(1, "w2", "boom")], [RingError(0, "w1", nccl)])
    assert (
        differs.verdict is Ring.FAIL
        and "deadlock" not in differs.reason
        and "rank 1 (w2) raised: 'boom'" in (differs.reason)
    )


def _config() -> RunConfig:
    return RunConfig(
        min_workers=2,
        max_workers=2,
        resources_per_worker={"CPU": 1.0},
        elastic_timeout=60.0,
        liveness_timeout=5.0,
        collective_timeout=20.0,
    )


def test_the_driver_fails_a_ring_that_raises_the_same_error_every_generation_quoting_it():
    """The fault: every allreduce of either rank raises NCCL's refusal at once, in every generation."""
    now = 100.0
    core = DriverCore(_config(), wall_offset=1000.0, started_at=now)

    def send(*messages):
        nonlocal now
        now += 0.01
        return core.handle(list(messages), now)

    spawned = [a.worker_id for a in send(m.HostsDiscovered({"A": 2})) if isinstance(a, m.Spawn)]
    [publish] = [a for a in send(*[m.WorkerReady(w) for w in spawned]) if isinstance(a, m.Publish)]
    refusal = "allreduce failed: ncclInvalidUsage: Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1a000"
    idle = {w: {"idle_s": 0.01, "in_collective": False} for w in publish.plan}
    for generation in (1, 2):
        send(*[m.WorkerSynced(w, generation, now + 1000.0) for w in publish.plan])
        ranks = sorted(publish.plan, key=lambda w: publish.plan[w].rank)
        actions = send(*[m.ResetRequested(w, generation, refusal) for w in ranks])
        assert [a for a in actions if isinstance(a, m.QueryActivity)], "the driver asks what the ranks are doing"
        actions = send(m.ActivityReport(generation, ranks[0], refusal, idle))
        if generation == 1:
            [publish] = [a for a in actions if isinstance(a, m.Publish)]
            assert core.state is not DriverState.FAILED
    assert core.state is DriverState.FAILED
    assert f"rank 0 ({ranks[0]}) raised: {refusal!r}" in core.failure
    assert "same error in two generations in a row" in core.failure
    assert "deadlock" not in core.failure


class _SeatKV:
    """The KV actor's `wait_family` as the ranks of one generation see it: every rank's seat, its own put first."""

    def __init__(self, others: dict[int, GpuSeat]) -> None:
        self.others = others
        self.calls: list[tuple] = []

    def wait_family(self, generation, prefix, count, timeout, put=None):
        self.calls.append((generation, prefix, count, timeout, put))
        key, value = put
        posted = {**self.others, int(key[len(prefix) :]): GpuSeat.decode(value)}
        return [posted[r].encode() for r in range(count)]


@pytest.fixture
def on_gpu_0(monkeypatch):
    import ray

    from ray_elastic.collective import devices, factory

    monkeypatch.setattr(devices, "ray_gpu_ids", lambda: ["0"])
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Ctx", (), {"get_node_id": lambda self: NODE})())
    factory._said.clear()
    return factory


def test_a_rank_posts_its_seat_and_plans_from_everyones_before_its_ring_forms(on_gpu_0, caplog):
    kv = _SeatKV({1: GpuSeat("w2", NODE, ("0",))})
    told: list[str] = []  # what rank 0 hands the driver, which makes it the run's backend_changed event
    with caplog.at_level("WARNING", logger="ray_elastic.collective.factory"):
        assert on_gpu_0._plan_gpu_ring(kv, 3, 0, 2, 30.0, "auto", "w1", told.append) == "gloo"
        assert on_gpu_0._plan_gpu_ring(kv, 4, 0, 2, 30.0, "auto", "w1", told.append) == "gloo"
    generation, prefix, count, timeout, (key, value) = kv.calls[0]
    assert (generation, count, timeout, key) == (3, 2, 30.0, f"{prefix}0")
    assert GpuSeat.decode(value) == GpuSeat("w1", NODE, ("0",))
    # one line says why, once per process: not at every generation
    assert [r.getMessage() for r in caplog.records] == [
        "generation 3: w1 (rank 0), w2 (rank 1) share GPU 0 of node a1b2c3d4e5f6 and NCCL allows one rank per GPU: "
        "this ring runs torch Gloo, its CUDA tensors staged through host memory (whole GPUs per worker give NCCL)"
    ]
    assert told == [caplog.records[0].getMessage().removeprefix("generation 3: ")]
    with pytest.raises(DeviceConflictError):
        on_gpu_0._plan_gpu_ring(kv, 5, 0, 2, 30.0, "nccl", "w1")
    assert on_gpu_0._plan_gpu_ring(_SeatKV({1: GpuSeat("w2", NODE, ("1",))}), 6, 0, 2, 30.0, "nccl", "w1") == "nccl"


def test_the_driver_makes_rank_0s_backend_reason_one_event_the_user_sees():
    from ray_elastic.config import RunConfig
    from ray_elastic.driver.core import messages as m
    from ray_elastic.driver.core.driver_core import DriverCore

    core = DriverCore(RunConfig(min_workers=1, max_workers=2, resources_per_worker={"CPU": 1.0}))
    reason = "w1 (rank 0), w2 (rank 1) share GPU 0 ...: this ring runs torch Gloo"
    core.handle([m.BackendNote(reason)], 1.0)
    core.handle([m.BackendNote(reason)], 2.0)  # every generation plans the same: one event
    assert [(e.kind, e.detail) for e in core.events] == [("backend_changed", reason)]
