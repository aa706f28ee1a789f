"""The driver's core replayed from message scripts: no Ray, milliseconds per test.

Each test drives `DriverCore` as the shell would (batches of messages with
a monotonic `now`) and asserts what a user would see: which generation forms
with whom, which workers are started or killed, which events `Result.events`
gets, and why a run fails.
"""

from __future__ import annotations

import pytest

from ray_elastic.config import RunConfig
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.driver_core import DriverCore, WorkerStatus
from ray_elastic.protocol import DriverState, EventKind, Finished, Removed, UserError


def config(**overrides) -> RunConfig:
    values = {
        "min_workers": 2,
        "max_workers": 4,
        "resources_per_worker": {"CPU": 1.0},
        "elastic_timeout": 60.0,
        "cooldown_range": (10.0, 300.0),
        "liveness_timeout": 5.0,
        "collective_timeout": 20.0,
    }
    values.update(overrides)
    return RunConfig(**values)


class Script:
    """A core and a clock: `send` delivers one batch at the current time and keeps the actions."""

    def __init__(self, **overrides) -> None:
        self.now = 100.0
        self.core = DriverCore(config(**overrides), wall_offset=1000.0, started_at=self.now)
        self.actions: list = []

    def send(self, *messages, after: float = 0.01) -> list:
        self.now += after
        self.actions = self.core.handle(list(messages), self.now)
        self.check_phase()
        return self.actions

    def check_phase(self) -> None:
        """The phase agrees with the membership: resetting exactly while a generation after the first syncs."""
        gens, state = self.core.generations, self.core.state
        if state in (DriverState.RUNNING, DriverState.RESETTING):
            resetting = gens.generation > 1 and bool(gens.syncing)
            assert (state is DriverState.RESETTING) == resetting, (state, gens.generation, sorted(gens.syncing))

    def of(self, kind) -> list:
        return [a for a in self.actions if isinstance(a, kind)]

    def start(self, hosts: dict[str, int]) -> m.Publish:
        """Discover `hosts`, let every worker boot, and return generation 1's publish."""
        self.send(m.HostsDiscovered(hosts))
        spawned = [a.worker_id for a in self.of(m.Spawn)]
        self.send(*[m.WorkerReady(w) for w in spawned])
        [publish] = self.of(m.Publish)
        self.sync(publish)
        return publish

    def sync(self, publish: m.Publish) -> None:
        self.send(*[m.WorkerSynced(w, publish.generation, self.now + 1000.0) for w in publish.plan])

    def kinds(self) -> list[tuple[str, int]]:
        return [(e.kind, e.generation) for e in self.core.events]


def test_generation_one_waits_for_every_newcomer_then_forms_oldest_host_first():
    s = Script()
    s.send(m.HostsDiscovered({"A": 2, "B": 2}))
    assert [(a.worker_id, a.host) for a in s.of(m.Spawn)] == [("w1", "A"), ("w2", "A"), ("w3", "B"), ("w4", "B")]
    assert s.core.state is DriverState.WAITING
    s.send(m.WorkerReady("w1"), m.WorkerReady("w2"), m.WorkerReady("w3"))
    assert s.of(m.Publish) == []  # w4 still boots: newcomers are admitted together
    s.send(m.WorkerReady("w4"))
    [publish] = s.of(m.Publish)
    assert publish.generation == 1 and publish.notify == ()
    assert [publish.plan[w].rank for w in ("w1", "w2", "w3", "w4")] == [0, 1, 2, 3]
    assert s.core.state is DriverState.RUNNING and s.core.resets == 0
    assert s.kinds() == [(EventKind.START, 1)]
    assert s.core.events[0].time == 1100.0  # the run's start, on the wall clock


def test_deaths_arriving_together_join_one_reset():
    s = Script()
    s.start({"A": 2, "B": 2})
    s.send(m.WorkerDied("w1", "node lost", node_alive=False), m.WorkerDied("w2", "node lost", node_alive=False))
    [publish] = s.of(m.Publish)
    assert publish.generation == 2 and set(publish.plan) == {"w3", "w4"}
    assert publish.notify == ("w3", "w4")
    assert [r.worker_id for r in s.of(m.Release)] == ["w1", "w2"]
    assert s.kinds()[1:] == [(EventKind.WORKER_FAILED, 2), (EventKind.WORKER_FAILED, 2)]
    # a lost node is not cooled, it is gone
    assert "A" not in s.core.record.hosts and not s.core.failures.cooldown.cooling(s.now)
    assert s.core.state is DriverState.RESETTING
    s.sync(publish)
    assert s.core.state is DriverState.RUNNING
    assert all(e.reset_duration is not None for e in s.core.events)
    assert [a.name for a in s.of(m.RecordMetric)] == ["recovery", "recovery"]


def test_a_members_death_tells_every_survivor_the_ring_is_dead_before_any_new_generation():
    """A rank blocked in a ring allreduce waits only on its neighbours: it must hear of a non-neighbour's death."""
    s = Script(min_workers=1)
    s.start({"A": 1, "B": 1, "C": 1})
    actions = s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True), m.WorkerDied("w3", "SIGKILL", node_alive=True))
    abandon = [a for a in actions if isinstance(a, m.Abandon)]
    # once per generation, to every member not yet known dead (w3's death comes after w2's in the batch)
    assert abandon == [m.Abandon(1, ("w1", "w3"), "worker w2 (rank 1) of generation 1 died")]
    assert actions.index(abandon[0]) < actions.index(s.of(m.Publish)[0]), "before the next generation is published"
    s.sync(s.of(m.Publish)[0])
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1, "D": 1}))
    [newcomer] = s.of(m.Spawn)
    assert s.send(m.WorkerDied(newcomer.worker_id, "failed to boot", node_alive=True)) == [
        m.Release(newcomer.worker_id)
    ], "a newcomer that never joined breaks no ring"


def test_a_death_during_a_reset_supersedes_it_and_late_syncs_are_ignored():
    s = Script(min_workers=1)
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerDied("w1", "killed", node_alive=True))
    [gen2] = s.of(m.Publish)
    s.send(m.WorkerSynced("w2", 2, s.now + 1000))  # w3 has not synced yet when it dies too
    s.send(m.WorkerDied("w3", "killed", node_alive=True))
    [gen3] = s.of(m.Publish)
    assert gen3.generation == 3 and list(gen3.plan) == ["w2"] and gen3.plan["w2"].rank == 0
    s.send(m.WorkerSynced("w3", 2, s.now + 1000))  # a sync of the superseded generation changes nothing
    assert s.core.state is DriverState.RESETTING
    s.sync(gen3)
    assert s.core.state is DriverState.RUNNING
    gen2_event, gen3_event = [e for e in s.core.events if e.kind is EventKind.WORKER_FAILED]
    # w1's reset was not over when w3 died: it ends with generation 3's sync, as w3's does
    assert gen2_event.reset_duration >= gen3_event.reset_duration >= 0
    assert s.core.failures.cooldown.cooling(s.now) == {"A", "C"}


def test_a_death_during_the_first_sync_still_ends_the_start_event_and_fit_is_sent_it_until_then():
    """The start line ("started with N workers in X s") waits for the start event's reset to end: it must end."""
    s = Script(min_workers=1)
    s.send(m.HostsDiscovered({"A": 1, "B": 1}))
    s.send(*[m.WorkerReady(a.worker_id) for a in s.of(m.Spawn)])
    start = next(e for e in s.core.events if e.kind is EventKind.START)
    s.send(m.WorkerDied("w2", "killed", node_alive=True))  # before generation 1 synced
    [gen2] = s.of(m.Publish)
    assert gen2.generation == 2 and start.reset_duration is None
    seen = len(s.core.events)  # fit() has seen every event so far
    first, resent = s.core.events.since(seen)
    assert start in resent and first == 0, "an event whose reset has not ended is sent to fit() again"
    s.sync(gen2)
    assert start.reset_duration is not None
    assert s.core.events.since(len(s.core.events)) == (len(s.core.events), [])


def test_a_sync_arriving_right_after_the_publish_is_counted():
    """Found by reading: the shell awaited the KV before recording who must sync, and dropped early syncs."""
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerDied("w3", "killed", node_alive=True))
    [publish] = s.of(m.Publish)
    # the core records who must sync when it decides, before the shell carries the publish out
    s.send(m.WorkerSynced("w1", 2, s.now + 1000), m.WorkerSynced("w2", 2, s.now + 1000))
    assert s.core.state is DriverState.RUNNING
    assert [a.name for a in s.of(m.RecordMetric)] == ["recovery"]


def test_a_newcomer_dying_before_admission_costs_no_reset_and_its_host_cools_down():
    s = Script(max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    [spawn] = s.of(m.Spawn)
    assert spawn == m.Spawn("w3", "C")
    s.send(m.WorkerDied("w3", "ActorDiedError", node_alive=True))
    assert s.of(m.Publish) == [] and s.core.generation == 1
    newcomer = s.core.events[-1]
    assert newcomer.kind is EventKind.NEWCOMER_FAILED and newcomer.reset_duration == 0.0
    assert "cooling down for 10 s" in newcomer.detail
    s.send(m.Tick(), after=5.0)
    assert s.of(m.Spawn) == []  # still cooling
    s.send(m.Tick(), after=6.0)
    assert s.of(m.Spawn) == [m.Spawn("w4", "C")]


def test_hosts_added_boot_while_the_others_train_and_join_in_one_reset():
    s = Script()
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 2}))
    assert [a.worker_id for a in s.of(m.Spawn)] == ["w3", "w4"]
    s.send(m.WorkerReady("w3"), after=4.0)
    assert s.of(m.Publish) == []
    s.send(m.WorkerReady("w4"), after=1.0)
    [publish] = s.of(m.Publish)
    assert publish.notify == ("w1", "w2") and len(publish.plan) == 4
    [added] = [e for e in s.core.events if e.kind is EventKind.HOSTS_ADDED]
    assert added.world_size == 4 and added.previous_world_size == 2
    assert "admitted after booting 5.0 s" in added.detail and added.time == s.now + 1000.0
    assert added.detail.startswith("2 new worker(s) on node C,"), added.detail


def test_a_replacement_on_a_node_back_from_its_cool_down_says_so():
    s = Script(min_workers=1)
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerDied("w2", "killed", node_alive=True))
    s.sync(s.of(m.Publish)[0])
    s.send(m.Tick(), after=11.0)  # B's 10 s cool-down is over
    [spawn] = s.of(m.Spawn)
    assert spawn.host == "B"
    s.send(m.WorkerReady(spawn.worker_id))
    [added] = [e for e in s.core.events if e.kind is EventKind.HOSTS_ADDED]
    assert added.detail.startswith("1 new worker(s) on node B (back after its cool-down),"), added.detail


def test_hosts_withdrawn_by_discovery_leave_gracefully_once_a_second_poll_confirms_it():
    s = Script(min_workers=1)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1}))
    assert s.of(m.Publish) == [] and s.core.workers["w2"].status is WorkerStatus.MEMBER
    s.send(m.HostsDiscovered({"A": 1}))
    [publish] = s.of(m.Publish)
    assert list(publish.plan) == ["w1"] and publish.notify == ("w1", "w2")
    assert s.core.workers["w2"].status is WorkerStatus.LEAVING
    assert s.kinds()[-1] == (EventKind.HOSTS_REMOVED, 2)
    s.send(m.WorkerExited("w2", Removed()))
    assert s.of(m.Kill) == [m.Kill("w2")] and "w2" not in s.core.alive_ids()
    assert s.of(m.Publish) == []


def test_a_one_poll_blip_of_no_hosts_costs_nothing():
    """Found trying it: a blip returning {} restarted training from scratch with untrained newcomers."""
    s = Script()
    s.start({"A": 2, "B": 2})
    s.send(m.HostsDiscovered({}))
    s.send(m.HostsDiscovered({"A": 2, "B": 2}))
    assert s.of(m.Spawn) == [] and s.of(m.Publish) == [] and s.of(m.Kill) == []
    assert s.core.generation == 1 and s.core.state is DriverState.RUNNING


def test_a_longer_withdrawal_of_every_host_keeps_the_oldest_member_until_it_is_offered_again():
    s = Script()
    s.start({"A": 2, "B": 2})
    s.send(m.HostsDiscovered({}))
    s.send(m.HostsDiscovered({}))
    # three leave, the oldest stays; alone it is below min_workers, so nothing is published yet
    assert [w for w, r in s.core.workers.items() if r.status is WorkerStatus.LEAVING] == ["w2", "w3", "w4"]
    assert s.core.workers["w1"].status is WorkerStatus.MEMBER
    assert s.of(m.Publish) == [] and s.core.state is DriverState.WAITING
    s.send(m.HostsDiscovered({"A": 2, "B": 2}))
    # offered again before anyone left: everyone stays, no newcomer, no reset
    assert all(r.status is WorkerStatus.MEMBER for r in s.core.workers.values())
    assert s.of(m.Spawn) == [] and s.of(m.Publish) == [] and s.core.state is DriverState.RUNNING


def test_a_replaced_pool_hands_the_state_over_before_the_old_members_leave():
    s = Script(min_workers=1, max_workers=2)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"C": 1, "D": 1}))
    s.send(m.HostsDiscovered({"C": 1, "D": 1}))
    # w1, the oldest, holds the state over: it counts toward max_workers, so one newcomer starts
    assert s.core.workers["w1"].status is WorkerStatus.MEMBER
    assert s.of(m.Spawn) == [m.Spawn("w3", "C")]
    [gen2] = s.of(m.Publish)
    assert list(gen2.plan) == ["w1"]  # w2 leaves gracefully
    s.sync(gen2)
    s.send(m.WorkerReady("w3"))
    [gen3] = s.of(m.Publish)
    assert gen3.plan["w1"].rank == 0 and gen3.plan["w3"].rank == 1  # the holder is rank 0: sync hands its state
    assert s.of(m.Spawn) == []
    s.sync(gen3)
    # as soon as w3 holds the state, w1 leaves, and its slot goes to a newcomer on D
    [gen4] = s.of(m.Publish)
    assert list(gen4.plan) == ["w3"] and s.of(m.Spawn) == [m.Spawn("w4", "D")]
    assert s.core.workers["w1"].status is WorkerStatus.LEAVING


def test_a_held_over_holder_leaves_only_once_every_newcomer_said_it_synced():
    """Found in CI: the holder left when the first newcomer said so; that one died, and the second's word was late."""
    s = Script(min_workers=1, max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"C": 1, "D": 1}))
    s.send(m.HostsDiscovered({"C": 1, "D": 1}))
    [gen2] = s.of(m.Publish)
    assert list(gen2.plan) == ["w1"]  # w1 holds the state over; w3 and w4 boot on C and D
    s.sync(gen2)
    s.send(m.WorkerReady("w3"), m.WorkerReady("w4"))
    [gen3] = s.of(m.Publish)
    assert list(gen3.plan) == ["w1", "w3", "w4"]
    s.send(m.WorkerSynced("w3", gen3.generation, s.now + 1000.0))
    assert s.of(m.Publish) == [] and s.core.workers["w1"].status is WorkerStatus.MEMBER, "w1 left before w4 synced"
    s.send(m.WorkerSynced("w4", gen3.generation, s.now + 1000.0))
    [gen4] = s.of(m.Publish)
    assert list(gen4.plan) == ["w3", "w4"] and s.core.workers["w1"].status is WorkerStatus.LEAVING
    s.send(m.WorkerDied("w3", "SIGKILL", node_alive=True))
    [gen5] = s.of(m.Publish)
    assert list(gen5.plan) == ["w4"] and s.core.state is not DriverState.FAILED


def test_a_sync_said_after_the_next_generation_was_published_still_makes_a_holder():
    s = Script(min_workers=1, max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    s.send(m.WorkerReady("w3"))
    [gen2] = s.of(m.Publish)
    s.send(m.WorkerSynced("w1", gen2.generation, s.now + 1000.0), m.WorkerSynced("w2", gen2.generation, s.now + 1000.0))
    s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True))
    [gen3] = s.of(m.Publish)
    assert list(gen3.plan) == ["w1", "w3"]
    s.send(m.WorkerSynced("w3", gen2.generation, s.now + 1000.0))  # its word on generation 2, late
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True))
    assert s.core.state is not DriverState.FAILED, s.core.failure
    [gen4] = s.of(m.Publish)
    assert list(gen4.plan) == ["w3"]
    assert EventKind.RESTARTED not in [kind for kind, _ in s.kinds()]


def test_a_draining_node_is_a_graceful_removal_named_preempted_and_gets_no_new_worker():
    s = Script(min_workers=1)
    s.start({"A": 2, "B": 2})
    s.send(m.NodesDraining({"B": 1000.0 + s.now + 30}))  # a deadline 30 s from now on the wall clock
    [publish] = s.of(m.Publish)
    assert set(publish.plan) == {"w1", "w2"} and publish.notify == ("w1", "w2", "w3", "w4")
    preempted = s.core.events[-1]
    assert preempted.kind is EventKind.PREEMPTED and preempted.generation == 2
    assert preempted.detail == "preempted: node B is draining (deadline in 30 s); w3, w4 leave"
    s.send(m.WorkerExited("w3", Removed()), m.WorkerExited("w4", Removed()))
    s.send(m.Tick(), after=20.0)
    assert s.of(m.Spawn) == [], "no worker is placed on a draining node"
    # once the node is gone and a new one offered, the slots are filled again, never on the gone node
    s.send(m.NodesDraining({}), m.HostsDiscovered({"A": 2, "C": 2}))
    assert [a.host for a in s.of(m.Spawn)] == ["C", "C"]
    s.send(m.HostsDiscovered({"A": 2, "C": 2}))
    assert s.of(m.Spawn) == []


def test_a_drain_without_deadline_says_so():
    s = Script(min_workers=1)
    s.start({"A": 1, "B": 1})
    s.send(m.NodesDraining({"B": 0.0}))
    assert "no deadline" in s.core.events[-1].detail


def test_a_user_error_ends_the_run_with_its_traceback_by_default():
    s = Script()
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w2", UserError("ValueError: boom", "Traceback ...\nValueError: boom")))
    assert s.core.state is DriverState.FAILED
    assert s.core.failure.startswith("train_fn raised in worker w2 (rank 1 on node B): ValueError: boom")
    assert "Traceback" in s.core.failure


def test_max_failures_retries_user_errors_as_worker_failures_then_fails():
    s = Script(max_failures=1, min_workers=1)
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w2", UserError("OSError: flaky", "tb")))
    assert s.core.state is DriverState.RESETTING
    assert m.Kill("w2") in s.actions and m.Release("w2") in s.actions
    failed = s.core.events[-1]
    assert failed.kind is EventKind.WORKER_FAILED and "retry 1 of max_failures=1" in failed.detail
    s.send(m.WorkerExited("w1", UserError("OSError: flaky", "tb")))
    assert s.core.state is DriverState.FAILED and "OSError: flaky" in s.core.failure


def test_a_mistake_that_would_repeat_is_not_retried_even_with_max_failures():
    s = Script(max_failures=3, min_workers=1)
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w1", UserError("train_fn's return value on rank 0 cannot be pickled", "", retryable=False)))
    assert s.core.state is DriverState.FAILED and s.of(m.Publish) == []
    assert s.core.failure == "worker w1 (rank 0 on node A): train_fn's return value on rank 0 cannot be pickled"


def test_losing_every_worker_says_what_each_died_of():
    s = Script(max_failures=2, min_workers=1)
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w1", UserError("ValueError: bad batch", "tb")))
    s.send(m.WorkerExited("w2", UserError("ValueError: bad batch", "tb")))
    assert s.core.state is DriverState.FAILED
    assert "no survivor holds the training state" in s.core.failure
    assert s.core.failure.count("ValueError: bad batch") == 2, s.core.failure


def test_a_broken_ring_with_every_member_alive_asks_once_and_kills_the_member_stuck_in_user_code():
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.ResetRequested("w1", 1, "timeout"), m.ResetRequested("w2", 1, "timeout"))
    [query] = s.of(m.QueryActivity)
    assert query.worker_ids == ("w1", "w2", "w3") and query.requester == "w1"
    busy, idle = {"idle_s": 0.1, "in_collective": True}, {"idle_s": 15.0, "in_collective": False}
    s.send(m.ActivityReport(1, "w1", "timeout", {"w1": busy, "w2": busy, "w3": idle}))
    assert s.of(m.Kill) == [m.Kill("w3", failed=True)]
    [publish] = s.of(m.Publish)  # the kill is its death: the ring re-forms without it at once
    assert publish.generation == 2 and set(publish.plan) == {"w1", "w2"}
    s.send(m.WorkerDied("w3", "killed", node_alive=True))
    assert s.of(m.Publish) == [] and s.core.resets == 1, "Ray's word of the death changes nothing"


def test_a_hung_member_is_killed_and_a_death_explains_a_broken_ring():
    s = Script()
    s.start({"A": 1, "B": 1})
    s.send(m.ResetRequested("w1", 1, "timeout"))
    s.send(m.ActivityReport(1, "w1", "timeout", {"w1": {"idle_s": 0, "in_collective": True}, "w2": m.ACTIVITY_TIMEOUT}))
    assert s.of(m.Kill) == [m.Kill("w2", failed=True)]
    s.send(m.WorkerDied("w2", "killed", node_alive=True), m.ResetRequested("w1", 1, "closed"))
    assert s.of(m.QueryActivity) == []  # a dead member explains the broken ring


def test_a_ring_timing_out_twice_with_everyone_busy_is_a_mismatch_not_a_loop():
    s = Script()
    s.start({"A": 1, "B": 1})
    busy = {"w1": {"idle_s": 0.0, "in_collective": True}, "w2": {"idle_s": 0.0, "in_collective": True}}
    s.send(m.ResetRequested("w1", 1, "timeout"))
    s.send(m.ActivityReport(1, "w1", "timeout", busy))
    [publish] = s.of(m.Publish)
    assert publish.generation == 2 and set(publish.plan) == {"w1", "w2"}
    assert s.kinds()[-1] == (EventKind.RESET_REQUESTED, 2)
    s.sync(publish)
    s.send(m.ResetRequested("w2", 2, "timeout"), after=20.0)
    s.send(m.ActivityReport(2, "w2", "timeout", busy))
    assert s.core.state is DriverState.FAILED
    assert "collectives do not match" in s.core.failure and "generations 1 and 2" in s.core.failure


def test_an_activity_report_for_a_superseded_generation_is_ignored():
    s = Script(min_workers=1)
    s.start({"A": 1, "B": 1})
    s.send(m.ResetRequested("w1", 1, "timeout"))
    s.send(m.WorkerDied("w2", "killed", node_alive=True))
    assert s.core.generation == 2
    s.send(m.ActivityReport(1, "w1", "timeout", {"w1": m.ACTIVITY_TIMEOUT}))
    assert s.of(m.Kill) == [] and s.core.state is not DriverState.FAILED


def test_liveness_kills_only_workers_whose_process_answered_before():
    s = Script(max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    s.send(m.PingResults(answered=frozenset({"w1"}), timed_out=frozenset({"w2", "w3"}), sent_at=s.now))
    # w2 said it was ready (its process is up): hung; w3 never answered: still booting, its boot deadline applies
    assert s.of(m.Kill) == [m.Kill("w2", failed=True)]


COMPUTING = m.CpuSample(busiest_thread_s=0.5, window_s=0.5, state="R")
IDLE = m.CpuSample(busiest_thread_s=0.0, window_s=0.5, state="S")


def missed_ping(s: Script, samples: dict, after: float = 7.0) -> list:
    """One liveness round, `after` seconds on, in which the workers of `samples` did not answer."""
    answered = frozenset(s.core.alive_ids()) - set(samples)
    sent = m.PingResults(answered, frozenset(samples), sent_at=s.now + after - 5.5, samples=samples)
    return s.send(sent, after=after)


def test_a_silent_member_that_computes_is_spared_until_collective_timeout():
    """A long C call holding the GIL keeps the ping from being answered: not a hang (collective_timeout=20 s)."""
    s = Script()
    s.start({"A": 1, "B": 1})
    for _ in range(3):  # silent since its first missed ping was sent: 5.5 s, 12.5 s, 19.5 s
        assert missed_ping(s, {"w2": COMPUTING}) == []
    assert s.core.workers["w2"].spared and s.core.resets == 0
    assert missed_ping(s, {"w2": COMPUTING})[0] == m.Kill("w2", failed=True)  # 26.5 s: past the peers' own limit


def test_a_member_that_answers_again_starts_a_new_silence():
    s = Script()
    s.start({"A": 1, "B": 1})
    missed_ping(s, {"w2": COMPUTING})
    missed_ping(s, {"w2": COMPUTING})
    missed_ping(s, {})  # the call returned: w2 answers
    assert not s.core.workers["w2"].spared and s.core.workers["w2"].silent_since is None
    for _ in range(3):  # a new silence: 19.5 s at the third round, not 33.5 s
        assert missed_ping(s, {"w2": COMPUTING}) == []


def test_a_silent_member_without_cpu_use_or_without_a_reading_is_killed_at_once():
    s = Script(min_workers=1, max_workers=3)
    s.start({"A": 1, "B": 1, "C": 1})
    actions = missed_ping(s, {"w2": IDLE, "w3": "no reading within 5 s (its node may be unreachable)"})
    assert [a for a in actions if isinstance(a, m.Kill)] == [m.Kill("w2", failed=True), m.Kill("w3", failed=True)]
    # the survivor hears at once that the ring is dead, once, before any new generation is published
    assert [a for a in actions if isinstance(a, m.Abandon)] == [
        m.Abandon(1, ("w1", "w3"), "worker w2 (rank 1) of generation 1 was killed")
    ]
    # a silent member that computed before and stops using the CPU is hung from then on
    s = Script()
    s.start({"A": 1, "B": 1})
    assert missed_ping(s, {"w2": COMPUTING}) == []
    assert missed_ping(s, {"w2": IDLE})[0] == m.Kill("w2", failed=True)


def test_a_worker_not_ready_within_elastic_timeout_is_killed_as_failed():
    s = Script(max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    s.send(m.Tick(), after=59.0)
    assert s.of(m.Kill) == []
    s.send(m.Tick(), after=2.0)
    assert s.of(m.Kill) == [m.Kill("w3", failed=True)]


def test_min_workers_not_reached_fails_after_elastic_timeout_naming_what_it_saw():
    s = Script(min_workers=3)
    s.send(m.HostsDiscovered({"A": 2}))
    s.send(m.WorkerReady("w1"), m.WorkerReady("w2"))
    s.send(m.Tick(), after=59.0)
    assert s.core.state is DriverState.WAITING
    s.send(m.Tick(), after=2.0)
    assert s.core.state is DriverState.FAILED
    assert s.core.failure == (
        "min_workers=3 not reached within elastic_timeout=60 s (ready workers: 2; slots offered: 2; "
        "hosts cooling down: 0)"
    )


def test_losing_every_member_without_a_checkpoint_fails_clearly():
    s = Script()
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerDied("w1", "x", node_alive=True), m.WorkerDied("w2", "x", node_alive=True))
    assert s.core.state is DriverState.FAILED
    assert s.core.failure.startswith(
        "all 2 workers of generation 1 were lost (w1, w2); no survivor holds the training state"
    )
    assert "configure checkpoint_dir" in s.core.failure


def test_losing_every_member_with_a_checkpoint_restarts_fresh_workers_from_it():
    s = Script(checkpoint_dir="file:///tmp/ckpt", cooldown_range=(1.0, 1.0))
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerDied("w1", "x", node_alive=True), m.WorkerDied("w2", "x", node_alive=True))
    assert s.of(m.LookForCheckpoint) == [m.LookForCheckpoint()]
    s.send(m.Tick())
    assert s.of(m.LookForCheckpoint) == []  # one lookup at a time
    s.send(m.CheckpointFound(True))
    assert s.core.state is DriverState.WAITING
    s.send(m.Tick(), after=1.5)
    fresh = [a.worker_id for a in s.of(m.Spawn)]
    assert fresh == ["w3", "w4"]
    s.send(*[m.WorkerReady(w) for w in fresh])
    [publish] = s.of(m.Publish)
    assert publish.generation == 2 and publish.notify == ()
    assert [kind for kind, generation in s.kinds() if generation == 2] == [
        EventKind.WORKER_FAILED,
        EventKind.WORKER_FAILED,
        EventKind.RESTARTED,
        EventKind.HOSTS_ADDED,
    ]


def test_no_checkpoint_found_after_losing_everyone_fails():
    s = Script(checkpoint_dir="file:///tmp/ckpt")
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerDied("w1", "x", node_alive=True), m.WorkerDied("w2", "x", node_alive=True))
    s.send(m.CheckpointFound(False))
    assert s.core.state is DriverState.FAILED and "no durable checkpoint was written yet" in s.core.failure


def test_rank0_finishing_ends_the_run_with_its_value_and_stops_newcomers():
    s = Script(max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    s.send(m.WorkerExited("w1", Finished(0, {"loss": 0.1})))
    assert m.Kill("w3") in s.actions and s.of(m.Publish) == []  # no reset while the run finishes
    assert s.core.state is DriverState.RUNNING
    s.send(m.WorkerExited("w2", Finished(1)))
    assert s.core.state is DriverState.DONE and s.core.return_value == {"loss": 0.1}


def test_ranks_returning_as_a_generation_admits_a_newcomer_end_the_run_without_waiting_for_it():
    """Found in CI: the newcomer waited for the ring the others never joined, and failed the run as uneven."""
    s = Script(max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    [spawn] = s.of(m.Spawn)
    s.send(m.WorkerReady(spawn.worker_id))
    [publish] = s.of(m.Publish)
    assert spawn.worker_id in publish.plan  # generation 2 admits it; w1 and w2 return from generation 1's last step
    s.send(m.WorkerExited("w1", Finished(0, "rank 0's model", generation=1)))
    assert m.Kill(spawn.worker_id) in s.actions and s.of(m.Publish) == []
    s.send(m.WorkerExited("w2", Finished(1, generation=1)))
    assert s.core.state is DriverState.DONE and s.core.return_value == "rank 0's model"


def test_a_rank_returning_before_rank0s_sync_is_heard_of_waits_for_rank0s_value():
    """A short train_fn: rank 1's return can reach the driver before rank 0's word that it synced."""
    s = Script()
    s.send(m.HostsDiscovered({"A": 1, "B": 1}))
    s.send(*[m.WorkerReady(a.worker_id) for a in s.of(m.Spawn)])
    [publish] = s.of(m.Publish)
    s.send(m.WorkerSynced("w2", publish.generation, s.now + 1000.0))
    s.send(m.WorkerExited("w2", Finished(1, generation=1)))
    assert m.Kill("w1") not in s.actions and s.core.state is not DriverState.DONE
    s.send(m.WorkerExited("w1", Finished(0, "rank 0's model", generation=1)))
    assert s.core.state is DriverState.DONE and s.core.return_value == "rank 0's model"


def test_ranks_finishing_at_different_steps_fail_at_once_keeping_rank0s_value():
    """Found trying it: uneven shards waited 900 s and ended in an unreadable RendezvousTimeoutError."""
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerExited("w1", Finished(0, "rank 0's model")))
    s.send(m.ResetRequested("w2", 1, "Connection closed by peer"))
    assert s.core.state is DriverState.FAILED and s.core.return_value == "rank 0's model"
    assert s.core.failure.startswith(
        "rank 0 (w1) returned from train_fn while rank 1 (w2), rank 2 (w3) still ran collectives with it"
    )
    assert "same step" in s.core.failure


def crash_and_resume(s: Script, victim: str, commits: int) -> str:
    """`victim` dies, the others resume from `commits` commits, its replacement joins; returns the replacement."""
    s.send(m.WorkerDied(victim, "ActorDiedError: exit code 134 (SIGABRT)", node_alive=True))
    [publish] = s.of(m.Publish)
    [spawn] = s.of(m.Spawn)  # no cool-down in this script: the slot is refilled at once
    s.send(*[m.WorkerSynced(w, publish.generation, s.now + 1000, commits) for w in publish.plan])
    if s.core.state is DriverState.FAILED:
        return spawn.worker_id
    s.send(m.WorkerReady(spawn.worker_id))
    [publish] = s.of(m.Publish)
    s.send(*[m.WorkerSynced(w, publish.generation, s.now + 1000, commits) for w in publish.plan])
    return spawn.worker_id


def test_a_failure_repeating_at_the_same_commit_ends_the_run_instead_of_looping():
    """Found trying it: a deterministic crash was retried forever (45 crashes in 120 s)."""
    s = Script(min_workers=1, cooldown_range=(0.0, 0.0))
    s.start({"A": 1, "B": 1})
    victim = crash_and_resume(s, "w2", commits=7)
    victim = crash_and_resume(s, victim, commits=8)  # a commit happened in between: progress
    victim = crash_and_resume(s, victim, commits=8)
    assert s.core.state is not DriverState.FAILED
    crash_and_resume(s, victim, commits=8)
    assert s.core.state is DriverState.FAILED
    assert s.core.failure.startswith("the run failed 3 times in a row resuming from the same commit (8)")
    assert "exit code 134 (SIGABRT)" in s.core.failure


def test_uneven_finishing_is_caught_when_the_peers_error_beats_rank0s_exit():
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.ResetRequested("w2", 1, "Connection closed by peer"))  # rank 0 closed its ring on the way out
    [query] = s.of(m.QueryActivity)
    s.send(m.WorkerExited("w1", Finished(0, "model")))
    busy = {"idle_s": 0.0, "in_collective": True}
    s.send(m.ActivityReport(1, "w2", "Connection closed by peer", {"w1": m.ACTIVITY_ERROR, "w2": busy, "w3": busy}))
    assert s.core.state is DriverState.FAILED and "returned from train_fn while" in s.core.failure


def test_uneven_finishing_is_caught_when_the_peers_errors_and_answers_all_beat_rank0s_exit():
    """Found in CI: both peers' words and their answers came before rank 0's return; the run hung for 300 s."""
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.ResetRequested("w2", 1, "Connection closed by peer"), m.ResetRequested("w3", 1, "Connection reset"))
    [query] = s.of(m.QueryActivity)
    idle = {"idle_s": 0.0, "in_collective": False}
    s.send(m.ActivityReport(1, "w2", "Connection closed by peer", {"w1": m.ACTIVITY_ERROR, "w2": idle, "w3": idle}))
    s.send(m.WorkerExited("w1", Finished(0, "model", generation=1)))
    assert s.core.state is DriverState.FAILED and "returned from train_fn while" in s.core.failure
    assert s.core.return_value == "model"


def test_reset_limit_fails_the_run_at_the_reset_past_it():
    s = Script(reset_limit=1, min_workers=1)
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerDied("w1", "x", node_alive=False))
    assert s.core.state is DriverState.RESETTING
    s.send(m.WorkerDied("w2", "x", node_alive=False))
    assert s.core.state is DriverState.FAILED and s.core.failure == "reset_limit=1 reached: 2 resets"


def test_discovery_failure_kv_loss_and_stop_end_the_run_with_their_reason():
    for message, text in (
        (m.DiscoveryFailed("script exited with 7"), "script exited with 7"),
        (m.KVLost("ActorDiedError"), "rendezvous (KV) actor died (ActorDiedError)"),
        (m.PublishFailed(2, "no answer within 5 s"), "did not take generation 2: no answer within 5 s"),
        (m.Stop("fit() was interrupted"), "fit() was interrupted"),
    ):
        s = Script()
        s.start({"A": 1, "B": 1})
        s.send(message)
        assert s.core.state is DriverState.FAILED and text in s.core.failure


def test_the_autoscaler_is_asked_for_missing_slots_once_and_released_when_offered():
    s = Script()
    s.send(m.HostsDiscovered({"A": 2}))
    assert s.of(m.RequestResources) == [m.RequestResources(4)]
    s.send(m.Tick())
    assert s.of(m.RequestResources) == []
    s.send(m.HostsDiscovered({"A": 2, "B": 2}))
    assert s.of(m.RequestResources) == [m.RequestResources(0)]


def test_ray_refusing_to_start_a_worker_fails_the_run_at_once_with_rays_message():
    s = Script()
    s.send(m.HostsDiscovered({"A": 2}))
    s.send(m.WorkerStartFailed("w1", "ValueError: bad resources"))
    assert s.core.state is DriverState.FAILED
    assert s.core.failure == "Ray could not start worker w1 on node A: ValueError: bad resources"


def test_an_unknown_message_is_a_driver_bug_not_a_silent_drop():
    with pytest.raises(TypeError, match="unknown message"):
        Script().send(object())


def test_a_restarted_kv_actor_is_told_the_generation_and_costs_a_reset_only_during_one():
    s = Script()
    publish = s.start({"A": 1, "B": 1})
    actions = s.send(m.KVRestarted("SIGKILL"))
    assert actions == [m.RestoreKV(1, dict(publish.plan))], "between resets: no new generation, no rollback"
    assert s.kinds()[-1] == (EventKind.KV_RESTARTED, 1) and s.core.resets == 0
    # during a reset the keys its ranks wrote are gone: the same members form the ring once more
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    [spawn] = s.of(m.Spawn)
    s.send(m.WorkerReady(spawn.worker_id))
    [gen2] = s.of(m.Publish)
    actions = s.send(m.KVRestarted("SIGKILL"))
    restore = [a for a in actions if isinstance(a, m.RestoreKV)]
    [gen3] = [a for a in actions if isinstance(a, m.Publish)]
    assert restore == [m.RestoreKV(2, dict(gen2.plan))] and actions.index(restore[0]) < actions.index(gen3)
    assert gen3.generation == 3 and set(gen3.plan) == set(gen2.plan)


# ---- a restarted driver ------------------------------------------------------------------


def restart(s: Script) -> list:
    """What a restarted driver does with its snapshot: unpickle the core and ask what may have been lost."""
    import pickle

    s.core = pickle.loads(pickle.dumps(s.core))
    s.now += 2.0  # Ray took a while to restart it
    return s.core.restarted(s.now, "its process died")


def test_a_restarted_driver_resumes_mid_run_asking_only_for_the_current_generation_again():
    s = Script()
    s.start({"A": 2})
    actions = restart(s)
    # no spawn, no kill, no new generation: the generation to the KV and the autoscaler's share (2 of 4 slots)
    assert actions == [m.RestoreKV(1, s.core.plan), m.RequestResources(4)]
    assert s.kinds() == [(EventKind.START, 1), (EventKind.DRIVER_RESTARTED, 1)]
    assert s.core.events[-1].reset_duration == 0.0
    s.send(m.Tick(), after=1.0)
    assert s.actions == [] and s.core.generation == 1 and s.core.state is DriverState.RUNNING


def test_a_driver_restarted_with_a_question_out_asks_it_again_and_the_answer_is_used():
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.ResetRequested("w1", 1, "timeout"))
    [query] = s.of(m.QueryActivity)
    actions = restart(s)
    assert query in actions, "the members' activity is asked again: the dead driver may never have asked"
    busy = {"idle_s": 0.1, "in_collective": True}
    s.send(
        m.ActivityReport(1, "w1", "timeout", {"w1": busy, "w2": busy, "w3": {"idle_s": 15.0, "in_collective": False}})
    )
    assert s.of(m.Kill) == [m.Kill("w3", failed=True)]


def test_a_driver_restarted_after_a_death_tells_the_survivors_again_and_messages_sent_twice_count_once():
    s = Script()
    publish = s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerDied("w3", "SIGKILL", node_alive=True))
    [second] = s.of(m.Publish)
    actions = restart(s)
    assert m.RestoreKV(2, s.core.plan) in actions
    # the survivors' syncs: one taken before the death and sent again by Ray after it, one new
    s.send(m.WorkerSynced("w1", 2, s.now + 1000.0), m.WorkerSynced("w1", 2, s.now + 1000.0))
    s.send(m.WorkerSynced("w2", 2, s.now + 1000.0), m.WorkerReady("w1"))
    assert s.core.generation == 2 and s.core.state is DriverState.RUNNING and s.of(m.Publish) == []
    kinds = [k for k, _ in s.kinds()]
    assert kinds == [EventKind.START, EventKind.WORKER_FAILED, EventKind.DRIVER_RESTARTED]
    assert publish.generation == 1 and second.generation == 2


def test_a_replacement_started_by_a_failure_is_announced_by_the_generation_that_admits_it():
    """Found running Horovod scripts: the replacement's hosts_added went out with the failure's generation."""
    s = Script(min_workers=1, max_workers=2)
    s.start({"A": 1, "B": 1, "C": 1})  # two workers; C's slot is spare
    s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True))
    [failed] = s.of(m.Publish)
    [replacement] = s.of(m.Spawn)
    assert failed.generation == 2 and list(failed.plan) == ["w1"] and replacement.host == "C"
    assert [e.kind for e in s.core.events if e.generation == 2] == [EventKind.WORKER_FAILED]
    s.sync(failed)
    s.send(m.WorkerReady(replacement.worker_id), after=3.0)
    [admitting] = s.of(m.Publish)
    [added] = [e for e in s.core.events if e.kind is EventKind.HOSTS_ADDED]
    assert added.generation == admitting.generation == 3
    assert added.world_size == 2 and added.previous_world_size == 1
    assert "admitted after booting 3.0 s" in added.detail, added.detail


def test_a_newcomer_that_dies_before_it_is_admitted_is_announced_by_no_generation():
    s = Script(min_workers=1, max_workers=3, cooldown_range=(600.0, 600.0))
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    [newcomer] = s.of(m.Spawn)
    s.send(m.WorkerDied(newcomer.worker_id, "failed to boot", node_alive=True))
    s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True))
    s.sync(s.of(m.Publish)[0])
    assert [e.kind for e in s.core.events if e.kind is EventKind.HOSTS_ADDED] == []


# ---- the control plane's review (issue 34, section 2) ------------------------------------


def test_rank0_lost_after_the_others_finished_fails_the_run_instead_of_succeeding_without_its_value():
    """Rank 0 SIGKILLed after its peers returned: `fit()` must not report success with return_value=None."""
    s = Script()
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w2", Finished(1)))
    s.send(m.WorkerDied("w1", "ActorDiedError: SIGKILL", node_alive=True))
    assert s.core.state is DriverState.FAILED
    assert s.core.failure.startswith("rank 0 (worker w1 on node A) was lost after rank 1 (w2) returned from train_fn")
    assert "ActorDiedError: SIGKILL" in s.core.failure and "return value" in s.core.failure
    # its train_fn raising after the loop, retried as a failure (max_failures), is the same loss
    s = Script(max_failures=2)
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w2", Finished(1)))
    s.send(m.WorkerExited("w1", UserError("OSError: disk full", "tb")))
    assert s.core.state is DriverState.FAILED and "OSError: disk full" in s.core.failure


def test_rank0_finishing_before_a_peer_is_lost_keeps_its_value():
    s = Script()
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w1", Finished(0, "model")))
    s.send(m.WorkerDied("w2", "ActorDiedError", node_alive=True))
    assert s.core.state is DriverState.DONE and s.core.return_value == "model"


def test_a_worker_killed_as_hung_is_dead_at_once_even_if_its_run_then_returns():
    """Its run() may return just before the kill: no death message follows, the ring must re-form anyway."""
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    actions = missed_ping(s, {"w2": IDLE})
    assert m.Kill("w2", failed=True) in actions
    [publish] = [a for a in actions if isinstance(a, m.Publish)]
    assert set(publish.plan) == {"w1", "w3"}, "the survivors, told to abandon, get their next generation now"
    s.send(m.WorkerExited("w2", Finished(1)))  # its run() had returned: no WorkerDied will come
    assert s.core.is_void("w2") and "w2" not in s.core.alive_ids() and s.core.state is DriverState.RESETTING
    failed = [e for e in s.core.events if e.kind is EventKind.WORKER_FAILED]
    assert len(failed) == 1 and "w2 (rank 1) on node B was killed: " in failed[0].detail
    assert "answer" in failed[0].detail, f"the event does not say why w2 was killed: {failed[0].detail}"


def test_rank0_killed_as_hung_after_returning_does_not_leave_the_run_hanging():
    s = Script(min_workers=1)
    s.start({"A": 1, "B": 1})
    [gen2] = [a for a in missed_ping(s, {"w1": IDLE}) if isinstance(a, m.Publish)]  # judged hung in its last flush
    s.send(m.WorkerExited("w1", Finished(0, "void: it was declared dead")))
    assert list(gen2.plan) == ["w2"] and gen2.plan["w2"].rank == 0, "the survivor goes on as rank 0"
    s.sync(gen2)
    s.send(m.WorkerExited("w2", Finished(0, "w2's model")))
    assert s.core.state is DriverState.DONE and s.core.return_value == "w2's model"


def test_a_newcomer_killed_at_its_boot_deadline_is_never_admitted_even_if_it_says_ready():
    s = Script(max_workers=3)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1}))
    s.send(m.Tick(), after=61.0)
    assert s.of(m.Kill) == [m.Kill("w3", failed=True)]
    s.send(m.WorkerReady("w3"))  # it was only slow: its ready beats its death to the driver
    assert s.of(m.Publish) == [] and s.core.generation == 1 and "w3" not in s.core.plan
    # the event says why a process the user saw alive was ended
    [lost] = [e for e in s.core.events if e.kind is EventKind.NEWCOMER_FAILED]
    assert "w3 on node C was killed before joining: it did not become ready within elastic_timeout=60 s" in lost.detail


def test_messages_of_a_worker_killed_as_hung_cause_no_extra_reset():
    s = Script(reset_limit=1)
    s.start({"A": 1, "B": 1, "C": 1})
    missed_ping(s, {"w3": IDLE})
    [gen2] = [a for a in s.actions if isinstance(a, m.Publish)]
    # the killed worker, still running a moment, reports its broken ring and syncs
    s.send(m.ResetRequested("w3", 2, "Connection closed by peer"), m.WorkerSynced("w3", 2, s.now + 1000))
    assert s.of(m.QueryActivity) == [] and s.of(m.Publish) == []
    s.sync(gen2)
    assert s.core.state is DriverState.RUNNING and s.core.resets == 1


def test_stale_messages_of_a_fenced_worker_do_not_fail_a_run_that_finishes():
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    missed_ping(s, {"w3": IDLE})
    [gen2] = [a for a in s.actions if isinstance(a, m.Publish)]
    s.sync(gen2)
    s.send(m.WorkerExited("w1", Finished(0, "model")))
    s.send(m.ResetRequested("w3", 1, "Connection closed by peer"))
    s.send(m.ActivityReport(1, "w3", "Connection closed by peer", {"w3": m.ACTIVITY_ERROR}))
    s.send(m.ResetRequested("w2", 1, "a stale word of the generation before"))
    s.send(m.WorkerExited("w2", Finished(1)))
    assert s.core.state is DriverState.DONE and s.core.return_value == "model", s.core.failure


def test_a_restarted_driver_resends_the_abandon_of_the_generation_before():
    """The dead driver decided 'abandon 1' and 'publish 2' in one batch and saved it, then died."""
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerDied("w3", "SIGKILL", node_alive=True))
    [abandon] = s.of(m.Abandon)
    actions = restart(s)
    assert abandon in actions and abandon.generation == 1 and abandon.worker_ids == ("w1", "w2")
    assert actions.index(abandon) < actions.index(m.RestoreKV(2, s.core.plan))


def test_a_restarted_driver_does_not_count_a_worker_it_killed_as_alive():
    """A kill decided and saved, but never carried out: the restarted driver must not watch that worker as alive."""
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    missed_ping(s, {"w2": IDLE})
    restart(s)
    assert "w2" not in s.core.alive_ids(), "alive_ids() is what the restarted driver keeps; the rest it removes"


def test_checkpoint_storage_that_fails_is_named_not_taken_for_no_checkpoint():
    s = Script(checkpoint_dir="s3://bucket/run")
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerDied("w1", "x", node_alive=True), m.WorkerDied("w2", "x", node_alive=True))
    s.send(m.CheckpointFound(False, error="PermissionError: access denied"))
    assert s.core.state is DriverState.FAILED
    assert "could not be looked for within elastic_timeout=60 s: PermissionError: access denied" in s.core.failure
    assert "no durable checkpoint was written yet" not in s.core.failure


def test_a_long_run_with_churn_keeps_the_drivers_records_flat():
    """Issue 34: a week of churn grew every record of the driver (and each change's cost) without bound."""
    s = Script(min_workers=1, max_workers=4, cooldown_range=(0.0, 0.0))
    s.core.events.capacity = 100
    hosts = {f"h{i}": 1 for i in range(4)}
    s.start(hosts)
    sizes = []
    for change in range(1, 1001):
        victim = next(iter(s.core.plan))
        if change % 2:  # its node is lost and a new one offered
            hosts.pop(s.core.workers[victim].host)
            hosts[f"h{change + 4}"] = 1
            s.send(m.WorkerDied(victim, "node lost", node_alive=False), m.HostsDiscovered(dict(hosts)))
        else:
            s.send(m.WorkerDied(victim, "SIGKILL", node_alive=True))
        for _ in range(3):  # the next generation syncs; the replacement boots and is admitted
            spawned, publishes = s.of(m.Spawn), s.of(m.Publish)
            for publish in publishes:
                s.sync(publish)
            s.send(*[m.WorkerReady(a.worker_id) for a in spawned], m.Tick(), after=0.5)
        assert len(s.core.plan) == 4 and s.core.state is DriverState.RUNNING, s.core.failure
        if change % 250 == 0:
            core = s.core
            sizes.append(
                (len(core.workers), len(core.record.roster.fenced), len(core.scaling.host_first_seen), len(core.events))
            )
    assert sizes[0] == sizes[-1], f"records grew with churn (workers, fenced, hosts, events): {sizes}"
    assert sizes[-1][0] <= 8 and sizes[-1][3] == 100
    assert s.core.events.dropped > 0 and len(s.core.failures.failure_places) <= 3


def test_status_sends_only_the_events_fit_has_not_seen_and_those_still_resetting():
    s = Script(min_workers=1)
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerDied("w3", "SIGKILL", node_alive=True))
    first, events = s.core.events.since(0)
    assert first == 0 and [e.kind for e in events] == [EventKind.START, EventKind.WORKER_FAILED]
    seen = first + len(events)
    first, events = s.core.events.since(seen)
    assert first == 1 and [e.kind for e in events] == [EventKind.WORKER_FAILED], "its reset still runs: sent again"
    s.sync(s.of(m.Publish)[0])
    first, events = s.core.events.since(seen)
    assert first == seen and events == [], "nothing new: nothing sent"


# ---- rank 0 holds the newest commit ----------------------------------------------------


def holders_lost_script(w4_synced: bool, **overrides) -> tuple[Script, str, str]:
    """w1, w2 train; w3 and w4 boot; w2 dies and w4 (ready first) joins; w1 dies. Returns (s, w3, w4).

    With `w4_synced` w4 finished its sync before w1 died, so it holds the trained state.
    """
    s = Script(min_workers=2, max_workers=4, **overrides)
    s.start({"A": 1, "B": 1})
    s.send(m.HostsDiscovered({"A": 1, "B": 1, "C": 1, "D": 1}))
    w3, w4 = (a.worker_id for a in s.of(m.Spawn))
    s.send(m.WorkerReady(w4))
    s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True))
    [gen2] = s.of(m.Publish)
    assert list(gen2.plan) == ["w1", w4], "the death admits the ready newcomer; w3 still boots"
    s.send(*[m.WorkerSynced(w, gen2.generation, s.now + 1000.0) for w in gen2.plan if w4_synced or w != w4])
    s.send(m.WorkerDied("w1", "SIGKILL", node_alive=True))
    return s, w3, w4


def test_a_newcomer_that_never_synced_is_never_rank0_over_a_worker_holding_the_state():
    """Ranks by spawn age made the older, never-synced w3 rank 0: its untrained model overwrote w4's state."""
    s, w3, w4 = holders_lost_script(w4_synced=True)
    assert s.of(m.Publish) == [] and s.core.state is DriverState.WAITING  # w4 alone is below min_workers
    s.send(m.WorkerReady(w3))
    [gen3] = s.of(m.Publish)
    assert gen3.plan[w4].rank == 0 and gen3.plan[w3].rank == 1, "the holder of the trained state is rank 0"
    assert EventKind.RESTARTED not in [kind for kind, _ in s.kinds()]


def test_every_holder_lost_with_only_newcomers_left_resumes_from_the_checkpoint_and_says_so():
    """w4 joined but its sync never finished when w1 died: nobody alive holds the state."""
    s, w3, w4 = holders_lost_script(w4_synced=False, checkpoint_dir="file:///tmp/ckpt")
    assert s.of(m.LookForCheckpoint) == [m.LookForCheckpoint()]
    s.send(m.CheckpointFound(True))
    s.send(m.WorkerReady(w3))  # A and B still cool down: w3 and w4 form the next generation
    [gen3] = s.of(m.Publish)
    assert set(gen3.plan) == {w3, w4}
    [restarted] = [e for e in s.core.events if e.kind is EventKind.RESTARTED]
    assert restarted.generation == gen3.generation
    assert restarted.detail.startswith("every worker holding the trained state was lost (w1); "), restarted.detail
    assert "resume from the durable checkpoint in file:///tmp/ckpt" in restarted.detail


def test_every_holder_lost_without_a_checkpoint_fails_naming_them():
    s, _, _ = holders_lost_script(w4_synced=False)
    assert s.core.state is DriverState.FAILED
    assert s.core.failure.startswith(
        "every worker holding the trained state was lost (w1); no survivor holds the training state"
    ), s.core.failure
    assert "configure checkpoint_dir" in s.core.failure and "worker w1 (rank 0): SIGKILL" in s.core.failure


# ---- what the driver writes after a batch (durability) -------------------------------------------------------------
def test_a_batch_that_changes_nothing_durable_writes_no_snapshot(monkeypatch):
    import asyncio

    from ray_elastic.auth import RunToken
    from ray_elastic.driver.shell import snapshot
    from ray_elastic.driver.shell.durability import CallLedger, DurableChanges

    s = Script(min_workers=1)
    gen = s.start({"A": 2, "B": 2})
    changes, ledger, written = DurableChanges(), CallLedger("run", RunToken()), []
    monkeypatch.setattr(snapshot, "save", lambda *args: written.append(args[1]))

    def batch(*messages) -> bool:
        changed = changes.seen(list(messages), s.send(*messages))
        asyncio.run(ledger.persist(s.core, (), core_changed=changed, rest_changed=False))
        return changed

    everyone = frozenset(gen.plan)
    assert batch(m.Tick()) is False and written == [1], "the first snapshot is written whatever the batch"
    assert batch(m.PingResults(everyone, frozenset(), s.now)) is False
    assert batch(m.Tick(), m.PingResults(everyone, frozenset(), s.now)) is False and written == [1]
    busy = {"w2": m.CpuSample(busiest_thread_s=0.5, window_s=0.5, state="R")}  # computing: spared, not killed
    assert batch(m.PingResults(everyone - {"w2"}, frozenset({"w2"}), s.now, busy)) is True  # a miss is recorded
    assert s.core.workers["w2"].spared
    assert batch(m.PingResults(everyone, frozenset(), s.now)) is True  # and so is its end
    assert batch(m.PingResults(everyone, frozenset(), s.now)) is False and written == [1, 2, 3]


def test_metric_sequence_numbers_are_kept_for_the_batches_that_carried_reports_only():
    from ray_elastic.driver.shell.durability import MetricSeqs, Seqs

    seqs = MetricSeqs()
    for i in range(1000):  # every rank's pace summaries alone, batch 1 of each
        assert seqs.take(f"w{i}", 1, reports=False)
    assert len(seqs) == 0 and seqs.version == 0
    assert seqs.take("w0", 2, reports=True) and not seqs.take("w0", 2, reports=True), "a batch sent again counts once"
    for seq in range(3, 500, 2):  # rank 0's reports in every other batch: the gaps never fill
        assert seqs.take("w0", seq, reports=True)
    assert len(seqs._seen["w0"].above) <= Seqs.SPAN + 1
    assert not seqs.take("w0", 499, reports=True)


def test_discovery_offering_the_same_hosts_again_changes_nothing_durable():
    from ray_elastic.driver.shell.durability import DurableChanges

    s = Script(min_workers=1)
    s.start({"A": 2, "B": 2})
    changes = DurableChanges()

    def seen(hosts: dict) -> bool:
        msg = m.HostsDiscovered(hosts)
        return changes.seen([msg], s.send(msg))

    assert seen({"A": 2, "B": 2}) is True  # the first poll this shell sees
    assert seen({"A": 2, "B": 2}) is False
    assert seen({"A": 2}) is True  # a host missing: kept for one more poll, and recorded so
    assert seen({"A": 2, "B": 2}) is True


def test_a_resume_within_the_run_says_why_the_disk_was_read():
    """A sharded model's rows lost with their replica: rank 0 reads the durable checkpoint, saying why."""
    s = Script(min_workers=1)
    gen = s.start({"A": 2, "B": 2})
    rank0 = next(w for w, slot in gen.plan.items() if slot.rank == 0)
    why = "resharding lost rows (rows 2-4 of tensor 0 were old rank 1's of 4: neither its owner nor replica is alive)"
    s.send(m.WorkerResumed(rank0, {"commit": 20, "world_size": 4, "reason": why}))
    [resumed] = [e for e in s.core.events if e.kind is EventKind.RESUMED]
    assert "loaded the durable checkpoint of commit 20" in resumed.detail and resumed.detail.endswith(why)
