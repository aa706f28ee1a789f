"""The driver core's incremental structures agree with planning whole.

A death at thousands of workers costs what it changed because the core
keeps the plan as columns (`assignment.Plan`, with `without` for members
that left), the roster journals its moves (`roster.Journal`) and pickles
as a base and the rows changed since, and scaling tells the slots a death
freed from that journal (`Scaling._after_deaths`). Each must give what the
whole computation gives: checked here on random inputs, and by replaying
random scripts on two cores, one of them made to plan whole every time.
"""

from __future__ import annotations

import pickle
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_elastic.assignment import LiveWorker, Plan, assign_ranks, order_key
from ray_elastic.config import RunConfig
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.driver_core import DriverCore
from ray_elastic.driver.core.generations import Generations
from ray_elastic.driver.core.roster import MOVES, Roster, WorkerStatus
from ray_elastic.driver.core.scaling import Scaling


def _workers(draw: st.DrawFn, most: int = 40) -> list[LiveWorker]:
    n = draw(st.integers(1, most))
    hosts = draw(st.lists(st.sampled_from("abcdefgh"), min_size=n, max_size=n))
    holds = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    seqs = draw(st.permutations(range(1, n + 1)))
    return [LiveWorker(f"w{s}", h, s, held) for s, h, held in zip(seqs, hosts, holds, strict=True)]


@st.composite
def _changes(draw: st.DrawFn) -> tuple[list[LiveWorker], list[tuple[set[str], set[str]]]]:
    """Workers, and rounds of (members gone, members that took the state since)."""
    workers = _workers(draw)
    ids = [w.worker_id for w in workers]
    rounds = []
    for _ in range(draw(st.integers(1, 4))):
        gone = set(draw(st.lists(st.sampled_from(ids), max_size=4)))
        took = set(draw(st.lists(st.sampled_from(ids), max_size=3)))
        rounds.append((gone, took))
    return workers, rounds


@settings(max_examples=400, deadline=None)
@given(_changes())
def test_a_plan_less_members_is_the_plan_assign_ranks_gives_them_or_none(case):
    """`Plan.without` gives exactly `assign_ranks`' plan of the members left (with their keys now), or None."""
    workers, rounds = case
    live = {w.worker_id: w for w in workers}
    plan = assign_ranks(workers)
    for gone, took in rounds:
        gone &= set(plan)
        for w in took:
            live[w] = live[w]._replace(holds=True)
        rekeyed = {w for w in took if w in plan}
        following = plan.without(gone, lambda w: order_key(live[w]), rekeyed)
        left = [live[w] for w in plan if w not in gone]
        whole = assign_ranks(left)
        if following is None:
            plan = whole
            continue
        assert dict(following) == dict(whole)
        assert list(following) == list(whole) and len(following) == len(whole)
        assert all(following.rank(w) == whole[w].rank for w in whole)
        assert all(w not in following and following.rank(w) is None for w in gone)
        copy = pickle.loads(pickle.dumps(following, protocol=pickle.HIGHEST_PROTOCOL))
        assert dict(copy) == dict(whole) and list(copy) == list(whole)
        assert all(copy.rank(w) == whole[w].rank for w in whole)
        plan = following


def test_a_death_in_a_full_fleet_keeps_the_order_without_planning_whole():
    """The common death (every member a holder, hosts filled in spawn order) never plans whole."""
    workers = [LiveWorker(f"w{i}", f"h{i // 8}", i, True) for i in range(1, 1025)]
    live = {w.worker_id: w for w in workers}
    plan = assign_ranks(workers)
    rng = random.Random(0)
    for _ in range(300):
        dead = rng.choice(list(plan))
        following = plan.without({dead}, lambda w: order_key(live[w]))
        assert following is not None
        plan = following
    assert dict(plan) == dict(assign_ranks([live[w] for w in plan]))


def test_ids_except_drops_by_position():
    plan = assign_ranks([LiveWorker(f"w{i}", f"h{i % 3}", i, False) for i in range(1, 10)])
    assert plan.ids_except({"w4", "nobody"}) == [w for w in plan if w != "w4"]
    assert isinstance(plan, Plan) and plan == dict(plan)


# ---- the roster's snapshot: a base and the rows changed since -----------------------------------------------------
def _record(roster: Roster) -> list:
    return [
        (
            w,
            r.host,
            r.seq,
            r.status,
            r.started_at,
            r.answered,
            r.silent_since,
            r.spared,
            r.holds_state,
            r.admitted_in,
            r.reason,
        )
        for w, r in roster.workers.items()
    ]


def _buckets(roster: Roster) -> dict:
    return {s: [r.worker_id for r in roster.live(s)] for s in WorkerStatus}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 10**6)), min_size=1, max_size=120))
def test_the_roster_pickled_as_a_base_and_rows_is_the_roster(ops):
    """Whatever happened to the workers, and whenever the snapshots were taken, a loaded roster is the roster."""
    roster = Roster()
    for op, x in ops:
        recs = list(roster.workers.values())
        rec = recs[x % len(recs)] if recs else None
        if op == 0 or rec is None:
            roster.new(f"h{x % 5}", float(x))
        elif op == 1:
            moves = sorted(MOVES[rec.status], key=lambda s: s.value)
            if moves:
                roster.move(rec, moves[x % len(moves)], f"because {x}")
        elif op == 2:
            rec.heard()
        elif op == 3:
            rec.went_silent(float(x))
        elif op == 4:
            rec.spare()
        elif op == 5:
            rec.admit(x % 7)
        elif op == 6:
            rec.took_state()
        elif op == 7:
            roster.fenced.add(rec.worker_id)
            named = x % 2 == 0
            roster.prune(lambda w: named)  # noqa: B023 - called here, in this iteration
        else:
            copy = pickle.loads(pickle.dumps(roster))  # a snapshot now: a base, or rows over it
            assert _record(copy) == _record(roster)
    copy = pickle.loads(pickle.dumps(roster))
    assert _record(copy) == _record(roster)
    assert _buckets(copy) == _buckets(roster)
    assert copy.unsettled == roster.unsettled and copy.fenced == roster.fenced
    assert (copy.version, copy._seq) == (roster.version, roster._seq)


# ---- two cores, one planning whole every time --------------------------------------------------------------------
def _whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Generations, "_following", lambda self: None)
    monkeypatch.setattr(Scaling, "_after_deaths", lambda self, now: None)


def _setup(seed: int) -> tuple[RunConfig, dict[str, int]]:
    """A run on random hosts: its options, and the hosts discovery offers first."""
    rng = random.Random(seed)
    hosts = {f"node{i}": rng.choice([1, 2, 4]) for i in range(rng.randint(2, 6))}
    max_workers = rng.randint(1, sum(hosts.values()) + 2)
    cooldown = (rng.choice([0.0, 2.0]), 8.0)
    config = RunConfig(
        min_workers=1, max_workers=max_workers, resources_per_worker={"CPU": 1.0}, cooldown_range=cooldown
    )
    return config, hosts


def _drive(core: DriverCore, seed: int, hosts: dict[str, int]) -> list:
    """Random batches (deaths of a process or a node, boots, syncs, time passing, hosts): what `core` did."""
    rng = random.Random(seed + 1000)
    now, seen = 0.0, []
    batch: list[m.Message] = [m.HostsDiscovered(dict(hosts))]
    starting: set[str] = set()
    for _ in range(40):
        now += rng.choice([0.1, 1.0, 3.0])
        actions = core.handle(batch, now)
        seen.append((repr(actions), core.generation, dict(core.plan), core.state, sorted(core.workers)))
        if core.state.is_final:
            break
        starting |= {a.worker_id for a in actions if isinstance(a, m.Spawn)}
        batch = []
        publish = [a for a in actions if isinstance(a, m.Publish)]
        for p in publish:
            batch += [m.WorkerSynced(w, p.generation, now) for w in p.plan if rng.random() < 0.9]
        r = rng.random()
        members = sorted(core.plan, key=lambda w: int(w[1:]))
        if r < 0.45 and members:
            dead = rng.choice(members)
            batch.append(m.WorkerDied(dead, "SIGKILL", node_alive=rng.random() < 0.85))
        elif r < 0.55 and members:
            batch += [m.WorkerDied(w, "SIGKILL", node_alive=True) for w in rng.sample(members, min(2, len(members)))]
        elif r < 0.65:
            hosts = dict(hosts)
            hosts[f"node{rng.randint(0, 7)}"] = rng.choice([1, 2, 4])
            batch.append(m.HostsDiscovered(hosts))
        if starting and rng.random() < 0.8:
            batch += [m.WorkerReady(w) for w in sorted(starting)]
            starting = set()
        if rng.random() < 0.3:
            batch.append(m.Tick())
    return seen


@pytest.mark.parametrize("seed", range(60))
def test_the_core_decides_as_it_does_planning_whole(seed, monkeypatch):
    """Deaths, boots, syncs, cool-downs and hosts: the incremental core's every action and plan are the whole one's."""
    config, hosts = _setup(seed)
    fast = _drive(DriverCore(config), seed, hosts)
    with monkeypatch.context() as patched:
        _whole(patched)
        whole = _drive(DriverCore(config), seed, hosts)
    assert fast == whole


# ---- the snapshot in the GCS: the core's small remainder, and its large parts under keys of their own ------------
class FakeGcs:
    """The GCS's key-value store, as `ray_private` reaches it."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.puts: list[bytes] = []

    def put(self, key, value, overwrite=True, namespace=None):
        self.data[key] = value
        self.puts.append(key)

    def get(self, key, namespace=None):
        return self.data.get(key)

    def delete(self, key, namespace=None):
        return int(self.data.pop(key, None) is not None)

    def list(self, prefix, namespace=None):
        prefix = prefix.encode() if isinstance(prefix, str) else prefix
        return [k for k in self.data if k.startswith(prefix)]


@pytest.fixture
def gcs(monkeypatch) -> FakeGcs:
    from ray_elastic import ray_private

    kv = FakeGcs()
    for name, fake in (("kv_put", kv.put), ("kv_get", kv.get), ("kv_del", kv.delete), ("kv_list", kv.list)):
        monkeypatch.setattr(ray_private, name, fake)
    return kv


def _fingerprint(core: DriverCore) -> tuple:
    workers = tuple((w, r.status, r.holds_state, r.host, r.reason) for w, r in sorted(core.workers.items()))
    return (core.state, core.generation, tuple(sorted(core.plan.items())), workers, len(core.events))


def test_after_a_death_the_gcs_takes_what_changed_and_a_restarted_driver_loads_it_whole(gcs):
    """A death's snapshot writes the core's remainder and no large part again; a restart loads every part."""
    import asyncio

    from ray_elastic.auth import RunToken
    from ray_elastic.driver.shell import snapshot
    from ray_elastic.driver.shell.durability import CallLedger

    config = RunConfig(min_workers=1, max_workers=2048, resources_per_worker={"CPU": 1.0})
    core, token = DriverCore(config), RunToken()
    spawned = [a.worker_id for a in core.handle([m.HostsDiscovered({f"n{i}": 8 for i in range(256)})], 1.0)]
    publish = next(a for a in core.handle([m.WorkerReady(w) for w in spawned], 2.0) if isinstance(a, m.Publish))
    core.handle([m.WorkerSynced(w, publish.generation, 3.0) for w in publish.plan], 3.0)
    ledger = CallLedger("run1", token)

    def persist() -> list[bytes]:
        gcs.puts.clear()
        assert asyncio.run(ledger.persist(core, ())) is None
        return list(gcs.puts)

    first = persist()
    parts = [k for k in first if k != b"driver/run1"]
    assert parts and first[-1] == b"driver/run1", "the large parts (the roster), then the snapshot naming them"
    # the first death plans whole (the journal does not reach back past 2048 admissions and syncs): a new plan
    core.handle([m.WorkerDied(spawned[50], "SIGKILL", node_alive=True)], 3.5)
    persist()
    core.handle([m.WorkerDied(spawned[100], "SIGKILL", node_alive=True)], 4.0)
    assert persist() == [b"driver/run1"], "a death writes no large part again"
    parts = [k for k in gcs.data if k != b"driver/run1"]
    assert len(gcs.data[b"driver/run1"]) < sum(len(gcs.data[k]) for k in parts) / 4

    restarted = CallLedger("run1", token)
    loaded, *_ = asyncio.run(restarted.load())
    assert _fingerprint(loaded) == _fingerprint(core)
    assert loaded.handle([m.WorkerDied(spawned[200], "SIGKILL", node_alive=True)], 5.0) == core.handle(
        [m.WorkerDied(spawned[200], "SIGKILL", node_alive=True)], 5.0
    )
    asyncio.run(restarted.persist(loaded, ()))  # its own parts; the loaded ones go
    assert all(k not in gcs.data for k in parts)
    assert asyncio.run(CallLedger("run1", token).load()) is not None

    forged = next(k for k in gcs.data if k != b"driver/run1")
    gcs.data[forged] = b"\0" * 32 + gcs.data[forged][32:]
    with pytest.raises(snapshot.ForgedSnapshotError, match="not signed"):
        asyncio.run(CallLedger("run1", token).load())
    snapshot.delete("run1")
    assert not gcs.data, "the run's clean-up takes its parts too"
