"""The driver shell's pure helpers, without Ray: how it builds its discovery and reads its calls' outcomes.

The shell (`driver_actor.py` and its parts) turns what Ray hands it into the core's
messages; these tests hold the parts of that translation a user would
notice: a restarted driver that fails a run on one discovery hiccup, or an
error read as a death that never comes.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from ray_elastic import ray_private
from ray_elastic.auth import RunToken
from ray_elastic.config import RunConfig
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.driver_core import DriverCore
from ray_elastic.driver.core.policies import Ring, judge_ring_failure
from ray_elastic.driver.shell import durability, snapshot
from ray_elastic.driver.shell.cluster_facts import make_poller
from ray_elastic.driver.shell.durability import CallLedger, DurableChanges, MetricSeqs
from ray_elastic.driver.shell.inbox import Inbox
from ray_elastic.driver.shell.metrics_log import MetricsLog
from ray_elastic.driver.shell.replies import read_activity, read_pings
from ray_elastic.driver.shell.worker_pool import WorkerPool
from ray_elastic.driver_actor import DriverActor
from ray_elastic.protocol import DriverState, EventKind
from ray_elastic.worker_actor import actor_class


def config(**overrides) -> RunConfig:
    values = {"min_workers": 1, "max_workers": 2, "resources_per_worker": {"CPU": 1.0}, "elastic_timeout": 60.0}
    values.update(overrides)
    return RunConfig(**values)


class Flaky:
    """A discovery callable whose service blinks."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        raise ConnectionError("the inventory service blinked")


def test_a_restarted_drivers_discovery_retries_a_transient_failure_within_elastic_timeout():
    """Issue 34: a restarted driver's first discovery hiccup failed the run instead of being retried."""
    source = Flaky()
    poller = make_poller(source, config(), resumed=True)
    assert poller.poll() is None, "the failure keeps the last view, as before the restart"
    assert source.calls == 1


def test_a_fresh_runs_first_discovery_failure_still_fails_at_once():
    poller = make_poller(Flaky(), config(), resumed=False)
    try:
        poller.poll()
    except Exception as e:  # noqa: BLE001 - DiscoveryError, checked by its text
        assert "the inventory service blinked" in str(e)
    else:
        raise AssertionError("a run whose discovery fails at its start must fail naming why")


def test_an_rpc_error_that_is_no_death_is_read_as_no_answer_not_as_a_death_or_nothing():
    """Issue 34: an activity() error was taken for a death that never came; a ping error was skipped for good."""
    results = {
        "w1": None,
        "w2": asyncio.TimeoutError(),
        "w3": ActorDiedError(),
        "w4": ActorUnavailableError("the actor is unreachable", None),
        "w5": RuntimeError("the call failed"),
    }
    answered, silent = read_pings(results)
    assert answered == {"w1"} and silent == {"w2", "w4", "w5"}, "the dead w3 is reported by its run() call"
    busy = {"idle_s": 0.0, "in_collective": True}
    assert read_activity("w1", busy) is busy
    assert read_activity("w3", ActorDiedError()) == m.ACTIVITY_ERROR
    for error in (asyncio.TimeoutError(), ActorUnavailableError("unreachable", None), RuntimeError("failed")):
        assert read_activity("w4", error) == m.ACTIVITY_TIMEOUT, error


def test_a_member_whose_activity_query_fails_without_dying_is_killed_so_the_ring_re_forms():
    activity = {"w1": {"idle_s": 0.0, "in_collective": True}, "w2": read_activity("w2", RuntimeError("failed"))}
    verdict = judge_ring_failure(activity, collective_timeout=20, liveness_timeout=5, last_timeout_reset=None, now=0.0)
    assert verdict.verdict is Ring.KILL and verdict.kill == ("w2",)


class FakeGcsKv:
    """The GCS key-value store `snapshot.py` writes to (through `ray_private`), as a dict."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def put(self, key, value, overwrite=True, namespace=None):
        self.data[key] = value

    def get(self, key, namespace=None):
        return self.data.get(key)


class RunsCode:
    """A pickle that runs code when loaded: what a hostile job would write."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def gcs(monkeypatch) -> FakeGcsKv:
    kv = FakeGcsKv()
    monkeypatch.setattr(ray_private, "kv_put", kv.put)
    monkeypatch.setattr(ray_private, "kv_get", kv.get)
    return kv


def test_the_drivers_snapshot_loads_only_with_the_runs_signature(gcs, tmp_path):
    """Issue 34: any job could write driver/<run_id> and run code in the restarted driver."""
    token = RunToken()
    snapshot.save("run1", 7, pickle.dumps({"generation": 3}), token)
    assert snapshot.load("run1", token) == (7, {"generation": 3})
    marker = tmp_path / "ran"
    forged = pickle.dumps(RunsCode(str(marker)))
    for stored in (forged, b"\0" * 32 + forged, RunToken().sign("driver snapshot/run1", forged) + forged):
        gcs.data[b"driver/run1"] = stored
        with pytest.raises(snapshot.ForgedSnapshotError, match="not signed with this run's secret"):
            snapshot.load("run1", token)
    assert not marker.exists(), "a forged snapshot is refused unread"
    snapshot.save("run2", 1, pickle.dumps("run2's"), token)
    gcs.data[b"driver/run1"] = gcs.data[b"driver/run2"]  # a run's own snapshot under another run's key
    with pytest.raises(snapshot.ForgedSnapshotError):
        snapshot.load("run1", token)


def test_each_snapshot_carries_its_write_counter_under_the_signature_and_confirms_it(gcs):
    """A signature says who wrote a snapshot, not when: the counter, signed with it, says when."""
    confirmed: list[int] = []
    ledger = CallLedger("run1", RunToken())
    ledger.confirm = confirmed.append

    async def scenario():
        for generation in (1, 1, 2):  # the second changes nothing: no write, no counter
            await ledger.persist({"generation": generation}, ())
        return await ledger.load()

    core, *_ = asyncio.run(scenario())
    assert core == {"generation": 2} and ledger.written == 2 and confirmed == [1, 2]
    # the counter is signed with the rest: changing it breaks the signature
    stored = bytearray(gcs.data[b"driver/run1"])
    stored[32 + 7] ^= 1
    gcs.data[b"driver/run1"] = bytes(stored)
    with pytest.raises(snapshot.ForgedSnapshotError):
        asyncio.run(ledger.load())


def test_a_restarted_driver_refuses_a_snapshot_older_than_the_kv_actor_confirmed():
    assert durability.judge_snapshot(counter=40, generation=3, confirmed=40, kv_generation=3) is None
    assert durability.judge_snapshot(counter=41, generation=3, confirmed=40, kv_generation=2) is None, (
        "the newest write's confirmation may be lost with the driver; a publish cut short leaves the KV behind"
    )
    assert durability.judge_snapshot(counter=12, generation=1, confirmed=40, kv_generation=3) == (
        "the driver's snapshot in the GCS is write 12, but the run's KV actor confirmed write 40: "
        "an older snapshot of this run was written back"
    )
    assert "holds generation 3" in durability.judge_snapshot(counter=45, generation=2, confirmed=40, kv_generation=3)
    assert durability.judge_snapshot(counter=12, generation=1, confirmed=0, kv_generation=0) is None, (
        "a restarted KV actor knows nothing: it refutes nothing (it is told the generation again)"
    )


def test_a_refused_snapshot_is_an_event_and_the_run_fails_naming_it():
    core = DriverCore(config())
    core.handle([m.SnapshotRefused("the driver's snapshot in the GCS is write 12, but ...")], now=5.0)
    assert [e.kind for e in core.events] == [EventKind.SNAPSHOT_REFUSED]
    assert core.state is DriverState.FAILED and "the restarted driver refused it" in core.failure


class RestartedDriver(DriverActor):
    """The real actor's call handling, with Ray's part stood in for: its loop applies and snapshots what comes."""

    def __init__(self) -> None:  # noqa: D107 - only what the calls and the loop touch
        self.run_id = "run1"
        self._run_token = RunToken()
        self.config = config()
        self.core = DriverCore(self.config)
        self.metrics = MetricsLog("run1")
        self._metric_seqs = MetricSeqs()
        self._metrics_written = None
        self._changes = DurableChanges()
        self.ledger = CallLedger("run1", self._run_token)
        self.inbox = Inbox(self.config, self.ledger, self.core.host_of)
        self.pool = WorkerPool("ns", self.config, self._run_token, self.inbox.put, actor_class())
        self._tasks = []
        self._started = asyncio.Event()
        self._drive_task = None

    async def _drive(self):
        self._started.set()
        while True:
            self.ledger.unwrap([await self.inbox.queue.get(), *self.inbox.drain()])
            await self._persist()


def test_a_restarted_drivers_loop_runs_when_resent_worker_calls_fill_every_slot_before_fits_run(monkeypatch):
    """Issue 34: 1000 resent worker calls took every slot of the restarted driver, all waiting on run()'s loop."""
    monkeypatch.setattr(snapshot, "save", lambda run_id, counter, blob, token, parts=None, stale=(): None)

    async def scenario():
        driver = RestartedDriver()
        slots = asyncio.Semaphore(3)  # Ray's max_concurrency

        async def call(method, *args):
            async with slots:
                return await method(*args)

        resent = [asyncio.ensure_future(call(driver.tell, m.WorkerSynced(f"w{i}", 2, 0.0))) for i in range(3)]
        run = asyncio.ensure_future(call(driver.run))  # scheduled after them: no slot is left for it
        await asyncio.wait_for(asyncio.gather(*resent), 5)  # answered once snapshotted, by the loop they started
        run.cancel()

    asyncio.run(scenario())


def test_the_drivers_start_arguments_wait_in_the_gcs_signed_and_a_forged_or_missing_one_is_named(gcs, tmp_path):
    """Issue 34: a restart must not hang on constructor arguments in the object store, nor run another job's code."""
    token = RunToken()
    snapshot.save_start("run1", token, b"train_fn's payload", "discover.sh")
    assert snapshot.load_start("run1", token) == (b"train_fn's payload", "discover.sh")
    marker = tmp_path / "ran"
    gcs.data[b"driver-start/run1"] = b"\0" * 32 + pickle.dumps(RunsCode(str(marker)))
    with pytest.raises(snapshot.ForgedSnapshotError, match="start arguments .* not signed with this run's secret"):
        snapshot.load_start("run1", token)
    assert not marker.exists()
    del gcs.data[b"driver-start/run1"]
    with pytest.raises(snapshot.StartMissingError, match="not in the GCS"):
        snapshot.load_start("run1", token)


def test_the_shell_lets_go_of_finished_queries_and_of_gone_workers():
    """Issue 34: a week of churn grew the shell's tasks, handles and per-worker records without bound."""

    async def scenario():
        driver = RestartedDriver()
        pool = driver.pool

        async def answered():
            return None

        for _ in range(100):
            driver._background(answered())
            await driver._tasks[-1]  # the query answers
        assert len(driver._tasks) <= 2
        for i in range(100):
            worker_id = f"w{i}"
            pool.handles[worker_id], pool.pids[worker_id] = object(), i
            driver._metric_seqs.take(worker_id, 1, reports=True)
            driver._release(worker_id)
        assert not pool.handles and not pool.pids and not driver._metric_seqs

    asyncio.run(scenario())


def test_a_restarted_drivers_bounded_wait_names_what_it_waited_for(monkeypatch):
    """A restart's wait on the GCS or the KV actor that runs out ends the run naming it, not a bare TimeoutError."""
    monkeypatch.setattr(durability, "KV_BACK_S", 0.01)
    with pytest.raises(durability.NoAnswerError, match="could not load its snapshot from the GCS within 0.01 s"):
        asyncio.run(durability.within("load its snapshot from the GCS", asyncio.sleep(5)))
