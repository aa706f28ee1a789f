"""Each part of the driver's core on its own: no Ray, no whole core, milliseconds per test.

`tests/unit/test_driver_core.py` replays message scripts through the whole core;
these hold each part to its one job, built on a bare `RunRecord` and only
the parts below it, so a part's behaviour is visible without the others'.
"""

from __future__ import annotations

import pytest
from test_driver_core import config

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.broken_rings import BrokenRings
from ray_elastic.driver.core.failures import Failures
from ray_elastic.driver.core.finishing import Finishing
from ray_elastic.driver.core.generations import Generations
from ray_elastic.driver.core.policies import PublishVerdict
from ray_elastic.driver.core.roster import WorkerStatus
from ray_elastic.driver.core.run_record import RunRecord
from ray_elastic.driver.core.scaling import Scaling
from ray_elastic.protocol import DriverState, EventKind, Finished


def record(**overrides) -> RunRecord:
    """The options the whole-core scripts use (`test_driver_core.config`), on a bare record."""
    return RunRecord(config(**overrides), wall_offset=1000.0, started_at=0.0)


class Parts:
    """The parts stacked as the core stacks them, over one record."""

    def __init__(self, **overrides) -> None:
        self.record = record(**overrides)
        self.gens = Generations(self.record)
        self.finishing = Finishing(self.record, self.gens)
        self.failures = Failures(self.record, self.gens, self.finishing)
        self.rings = BrokenRings(self.record, self.gens, self.finishing, self.failures)
        self.scaling = Scaling(self.record, self.gens, self.failures.cooldown)

    def ready(self, hosts: dict[str, int], now: float = 1.0) -> list[str]:
        """Workers recorded on `hosts` and ready."""
        ids = []
        for host, count in hosts.items():
            for _ in range(count):
                rec = self.record.roster.new(host, now)
                self.record.roster.move(rec, WorkerStatus.READY, "it said it is ready")
                ids.append(rec.worker_id)
        return ids

    def formed(self, hosts: dict[str, int], now: float = 1.0) -> list[str]:
        """A generation of ready workers on `hosts`, published and synced."""
        ids = self.ready(hosts, now)
        self.gens.maybe_publish(now, finishing=False)
        for w in ids:
            self.gens.on_synced(m.WorkerSynced(w, self.gens.generation, now))
        self.record.take_actions()
        return ids


# ---- the roster ------------------------------------------------------------------------


def test_a_workers_status_moves_only_as_the_table_allows_and_keeps_its_reason():
    from ray_elastic.driver.core.roster import StatusError

    p = Parts()
    [a] = p.ready({"A": 1})
    rec = p.record.roster[a]
    assert rec.reason == "it said it is ready"
    with pytest.raises(StatusError, match="cannot move from ready to finished"):
        p.record.roster.move(rec, WorkerStatus.FINISHED, "returned")
    p.record.roster.move(rec, WorkerStatus.GONE, "died: SIGKILL")
    with pytest.raises(StatusError, match="cannot move from gone to member"):
        p.record.roster.move(rec, WorkerStatus.MEMBER, "admitted")
    assert rec.status is WorkerStatus.GONE and rec.reason == "died: SIGKILL"
    with pytest.raises(AttributeError):
        rec.status = WorkerStatus.MEMBER  # no other way in


def test_the_roster_keeps_a_gone_worker_while_something_names_it_and_its_word_stays_void_after():
    p = Parts()
    a, b = p.ready({"A": 2})
    p.record.roster.move(p.record.roster[a], WorkerStatus.GONE, "died")
    p.record.roster.fenced.add(a)
    p.record.roster.prune(named=lambda w: w == a)
    assert a in p.record.roster.workers and p.record.roster.is_void(a)
    p.record.roster.prune(named=lambda w: False)
    assert a not in p.record.roster.workers and p.record.roster.is_void(a), "pruned: its word is void all the same"
    assert not p.record.roster.is_void(b)


# ---- generations -----------------------------------------------------------------------


def test_a_generation_forms_only_from_min_workers_ranks_oldest_first_and_binds_the_waiting_events():
    p = Parts()
    [w1] = p.ready({"A": 1})
    assert p.gens.maybe_publish(1.0, finishing=False).verdict is PublishVerdict.BELOW_MIN
    [w2] = p.ready({"B": 1})
    p.gens.later(p.gens.event(EventKind.HOSTS_ADDED, "B offered", 1.5))
    published = p.gens.maybe_publish(2.0, finishing=False)
    assert published.verdict is PublishVerdict.NOW and published.membership_changed
    [publish] = [a for a in p.record.take_actions() if isinstance(a, m.Publish)]
    assert [publish.plan[w].rank for w in (w1, w2)] == [0, 1]
    assert [(e.kind, e.generation, e.world_size) for e in p.record.events] == [
        (EventKind.HOSTS_ADDED, 1, 2),
        (EventKind.START, 1, 2),
    ]


def test_a_generation_synced_whole_gives_its_events_their_reset_duration_and_its_resume_place():
    p = Parts()
    w1, w2 = p.formed({"A": 1, "B": 1})
    p.gens.later(p.gens.event(EventKind.WORKER_FAILED, "w9 died", 10.0))
    p.gens.reform()
    p.gens.maybe_publish(10.0, finishing=False)
    assert p.gens.on_synced(m.WorkerSynced(w1, 2, 1010.5, commits=7)) == (False, None)
    assert p.gens.on_synced(m.WorkerSynced(w2, 2, 1010.8, commits=7)) == (True, 7)
    [failed] = p.record.events.of_generation(2)
    assert abs(failed.reset_duration - 0.8) < 1e-9


def test_waiting_below_min_workers_past_elastic_timeout_fails_naming_what_there_was():
    p = Parts(elastic_timeout=5.0)
    p.ready({"A": 1})
    p.record.hosts = {"A": 1}
    assert not p.gens.check_wait(4.0, cooling=0)
    assert p.gens.check_wait(6.0, cooling=1)
    assert p.record.phase.current is DriverState.FAILED
    assert "min_workers=2 not reached within elastic_timeout=5 s" in p.record.failure
    assert "ready workers: 1; slots offered: 1; hosts cooling down: 1" in p.record.failure


# ---- finishing -------------------------------------------------------------------------


def test_rank0_returning_ends_the_run_with_its_value_once_every_member_ended():
    p = Parts()
    w1, w2 = p.formed({"A": 1, "B": 1})
    p.finishing.on_exit(m.WorkerExited(w1, Finished(rank=0, value=b"model")))
    assert p.finishing.active and not p.record.phase.is_final, "rank 1 still trains"
    p.finishing.on_exit(m.WorkerExited(w2, Finished(rank=1, value=None)))
    assert p.record.phase.current is DriverState.DONE and p.finishing.return_value == b"model"


def test_a_ring_broken_after_a_rank_returned_fails_as_an_uneven_finish_naming_both_sides():
    p = Parts()
    w1, w2 = p.formed({"A": 1, "B": 1})
    p.finishing.on_exit(m.WorkerExited(w2, Finished(rank=1, value=None)))
    p.finishing.fail_uneven(w1, "connection closed")
    assert f"rank 1 ({w2}) returned from train_fn while rank 0 ({w1}) still ran collectives" in p.record.failure


# ---- failures --------------------------------------------------------------------------


def test_a_members_death_fences_it_tells_the_others_once_and_cools_its_host_unless_the_node_is_gone():
    p = Parts()
    w1, w2, w3 = p.formed({"A": 1, "B": 1, "C": 1})
    p.record.hosts = {"A": 1, "B": 1, "C": 1}
    p.failures.on_died(w2, "SIGKILL", node_alive=True, now=5.0)
    p.failures.on_died(w3, "node lost", node_alive=False, now=5.0)
    actions = p.record.take_actions()
    [abandon] = [a for a in actions if isinstance(a, m.Abandon)]
    assert abandon.worker_ids == (w1, w3) and abandon.generation == 1, "once per generation, to those alive then"
    assert p.record.roster.is_void(w2) and p.record.roster.is_void(w3)
    assert p.failures.cooldown.cooling(5.0) == {"B"} and "C" not in p.record.hosts


def test_failures_that_keep_resuming_from_the_same_commit_are_a_crash_loop():
    p = Parts()
    p.formed({"A": 1, "B": 1, "C": 1})
    for generation in (2, 3, 4):
        ev = p.gens.event(EventKind.WORKER_FAILED, "worker w2 died", 1.0)
        ev.generation = generation
        p.record.events.append(ev)
        p.failures.note_cause("worker w2: CUDA error")
        p.failures.check_crash_loop(generation, place=40)
    assert p.record.phase.current is DriverState.FAILED and "CUDA error" in p.record.failure


def test_every_member_lost_without_checkpoint_dir_fails_naming_the_option_and_the_causes():
    p = Parts()
    w1, w2 = p.formed({"A": 1, "B": 1})
    p.failures.on_died(w1, "OOM", node_alive=True, now=2.0)
    p.failures.on_died(w2, "OOM", node_alive=True, now=2.0)
    p.failures.all_lost()
    assert "configure checkpoint_dir" in p.record.failure and f"worker {w1} (rank 0): OOM" in p.record.failure


# ---- broken rings ----------------------------------------------------------------------


def test_a_silent_member_that_computes_is_spared_and_one_that_uses_no_cpu_is_killed():
    p = Parts()
    w1, w2 = p.formed({"A": 1, "B": 1})
    for w in (w1, w2):
        p.record.roster[w].answered = True
    busy = m.CpuSample(busiest_thread_s=0.5, window_s=0.5, state="R")
    idle = m.CpuSample(busiest_thread_s=0.0, window_s=0.5, state="S")
    p.rings.on_pings(
        m.PingResults(answered=frozenset(), timed_out=frozenset({w1, w2}), sent_at=3.0, samples={w1: busy, w2: idle}),
        now=9.0,
    )
    kills = [a for a in p.record.take_actions() if isinstance(a, m.Kill)]
    assert [(k.worker_id, k.failed) for k in kills] == [(w2, True)]
    assert p.record.roster[w1].spared and p.record.roster[w2].status is WorkerStatus.GONE


def test_a_ring_broken_with_every_member_idle_and_alive_is_re_formed_once_and_asked_about_first():
    p = Parts()
    w1, w2 = p.formed({"A": 1, "B": 1})
    p.rings.on_reset_requested(m.ResetRequested(w1, 1, "timed out"))
    [query] = [a for a in p.record.take_actions() if isinstance(a, m.QueryActivity)]
    assert query.worker_ids == (w1, w2)
    idle = {"idle_s": 0.0, "in_collective": True}
    p.rings.on_activity(m.ActivityReport(1, w1, "timed out", {w1: idle, w2: idle}), now=30.0)
    assert p.gens.maybe_publish(30.0, finishing=False).verdict is PublishVerdict.NOW, "the same members, again"
    assert [e.kind for e in p.record.events.of_generation(2)] == [EventKind.RESET_REQUESTED]


# ---- scaling ---------------------------------------------------------------------------


def test_a_host_missing_from_one_poll_keeps_its_workers_and_a_draining_one_gets_none():
    p = Parts()
    p.scaling.update_hosts({"A": 2, "B": 2}, now=1.0)
    p.scaling.reconcile(1.0)
    spawned = [a.host for a in p.record.take_actions() if isinstance(a, m.Spawn)]
    assert sorted(spawned) == ["A", "A", "B", "B"]
    p.scaling.update_hosts({"A": 2}, now=2.0)
    assert p.record.hosts == {"A": 2, "B": 2}, "a blip: B is kept until the next poll confirms it"
    p.scaling.update_hosts({"A": 2}, now=3.0)
    assert p.record.hosts == {"A": 2}
    p.scaling.on_draining({"A": 0.0}, now=4.0)
    p.scaling.update_hosts({"A": 2, "C": 2}, now=4.0)
    p.scaling.reconcile(4.0)
    assert {a.host for a in p.record.take_actions() if isinstance(a, m.Spawn)} <= {"C"}


def test_the_autoscaler_is_asked_for_max_workers_while_the_cluster_offers_fewer_slots():
    p = Parts(max_workers=4)
    p.scaling.update_hosts({"A": 2}, now=1.0)
    p.scaling.reconcile(1.0)
    assert [a.bundles for a in p.record.take_actions() if isinstance(a, m.RequestResources)] == [4]
    assert p.scaling.request_again() == [m.RequestResources(4)]
    p.scaling.update_hosts({"A": 2, "B": 2}, now=2.0)
    p.scaling.reconcile(2.0)
    assert [a.bundles for a in p.record.take_actions() if isinstance(a, m.RequestResources)] == [0]
