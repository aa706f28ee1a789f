"""A model of the driver's shell and workers, and the run's invariants, for the model-based test of the core.

`play(seed)` drives `DriverCore` with random but legal shell behaviour, all
drawn from one seeded generator: workers that boot (or never do), syncs
whose word comes late or never, deaths (a process, or its whole node),
discovery adding and withdrawing hosts (blips included), paces that make a
straggler, ranks that finish (evenly or not), ring errors and the members'
answers, checkpoint lookups answered late, driver restarts from the
snapshot, and messages duplicated and reordered. The model keeps the truth
the core cannot see: which processes live and how far each worker's state
has trained. After every batch the invariants (`check_*`, each written once)
are checked against it; at the end the run is left to settle (every message
delivered, every question answered, time past every deadline) and must not
wait for ever.

A violation raises `Violation` naming the seed and the script's last steps:
such a seed is kept as a named regression test in `test_driver_model.py`.
"""

from __future__ import annotations

import logging
import pickle
import random
from dataclasses import dataclass, field
from typing import Any

from ray_elastic.config import RunConfig
from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.driver_core import DriverCore
from ray_elastic.driver.core.roster import ALIVE, SPARES, WorkerStatus
from ray_elastic.driver.core.stragglers import WINDOW
from ray_elastic.protocol import DriverState, EventKind, Finished, PaceSummary, Removed, UserError

POOL = ("A", "B", "C", "D", "E")
# what a worker itself sends
_SAID = (m.WorkerSynced, m.WorkerReady, m.ResetRequested, m.TrainFnRaised, m.PacesReported)
_ALL_LOST = ("holding the trained state was lost", "workers of generation")


class Violation(AssertionError):
    """An invariant broke: the message names the seed, the invariant and the script's last steps."""


@dataclass
class Worker:
    """A worker process as it really is (the core learns of it only through messages)."""

    host: str
    alive: bool = True
    exited: bool = False
    progress: int | None = None  # commits its state has seen; None: it never received the run's state
    never_boots: bool = False
    hung: bool = False  # stopped answering: it neither trains nor returns until the core kills it

    @property
    def running(self) -> bool:
        return self.alive and not self.exited and not self.hung


@dataclass
class Finish:
    """The ranks of `generation` return from train_fn; `uneven` keeps one of them in its collectives."""

    generation: int
    plan: dict[str, Any]
    uneven: str | None
    value: str
    said: set[str] = field(default_factory=set)  # workers whose return (or ring error) was delivered
    rank0_said: bool = False
    broke_in: set[int] = field(default_factory=set)  # generations whose ring the uneven rank told broken
    exits: list[Any] = field(default_factory=list)  # the workers' exits delivered since the ranks returned


class Model:
    """The shell and the workers around one `DriverCore`: what they send, and the truth the invariants need."""

    def __init__(self, seed: int, steps: int = 30) -> None:
        self.seed, self.steps = seed, steps
        self.rng = rng = random.Random(seed)
        min_workers = rng.choice((1, 1, 2, 2, 3))
        self.config = RunConfig(
            min_workers=min_workers,
            max_workers=rng.choice((min_workers, min_workers + 1, 4)),
            resources_per_worker={"CPU": 1.0},
            elastic_timeout=rng.choice((60.0, 60.0, 15.0)),
            cooldown_range=rng.choice(((5.0, 40.0), (5.0, 40.0), (1.0, 1.0), (20.0, 100.0))),
            liveness_timeout=rng.choice((5.0, 5.0, 2.0)),
            collective_timeout=rng.choice((20.0, 20.0, 6.0)),
            checkpoint_dir="file:///tmp/model-ckpt" if rng.random() < 0.5 else None,
            max_failures=rng.choice((0, 2, 5, -1)),
            spares=rng.choice((0, 0, 1, 2)),
        )
        self.now = 100.0
        self.core = DriverCore(self.config, wall_offset=1000.0, started_at=self.now)
        self.workers: dict[str, Worker] = {}
        self.offered = {h: rng.choice((1, 1, 2)) for h in rng.sample(POOL, rng.randint(1, 3))}
        self.pending: list[m.Message] = [m.HostsDiscovered(dict(self.offered))]
        self.delivered: list[m.Message] = []  # every message delivered so far (duplicates are drawn from it)
        self.kinds_delivered: set[type] = set()  # the types of every message delivered, Ticks included
        self.generation = 0
        self.plan: dict[str, Any] = {}
        self.ring_synced: set[int] = set()  # generations whose ring formed and whose ranks took rank 0's state
        self.trained: set[int] = set()  # generations that committed at least once
        self.resumed: set[int] = set()  # generations the core resumed from the durable checkpoint
        self.run_progress = -1  # the newest commit the run made (or resumed from); -1: no ring formed yet
        self.durable: int | None = None  # the newest durable checkpoint's commit
        self.lookups = 0  # checkpoint lookups out
        self.queries: list[m.QueryActivity] = []
        self.draining: set[str] = set()
        self.finish: Finish | None = None
        self.log: list[str] = []
        self.final_before = False  # whether the run had ended before the batch being checked
        self.raised_in: set[int] = set()  # generations in which a delivered TrainFnRaised says a rank raised

    # ---- carrying out the core's actions ---------------------------------------------------------
    def act(self, actions: list[m.Action]) -> None:
        for action in actions:
            if isinstance(action, m.Spawn):
                never = self.rng.random() < 0.08
                self.workers[action.worker_id] = Worker(action.host, never_boots=never)
            elif isinstance(action, m.Kill):
                w = self.workers.get(action.worker_id)
                if w is not None and w.alive:
                    w.alive = False
                    if not w.exited:
                        self.pending.append(m.WorkerDied(action.worker_id, "killed by the driver", True))
            elif isinstance(action, m.Publish):
                self._published(action)
            elif isinstance(action, m.RestoreKV) and action.generation > self.generation:
                # a restarted driver puts the generation whose publish was lost: the members learn it from the KV
                # actor, the ones it leaves out at their next check
                self._published(m.Publish(action.generation, action.plan, tuple(self.plan)))
            elif isinstance(action, m.QueryActivity):
                self.queries.append(action)
            elif isinstance(action, m.LookForCheckpoint):
                self.lookups += 1

    def _published(self, publish: m.Publish) -> None:
        resuming = self.generation in self.resumed and self.generation not in self.ring_synced
        self.generation, self.plan = publish.generation, dict(publish.plan)
        restarted = any(e.kind is EventKind.RESTARTED and e.generation == publish.generation for e in self.core.events)
        if restarted or resuming:  # a resume goes on until a generation's ring formed: its rank 0 loads the checkpoint
            self.resumed.add(publish.generation)
        for worker_id in publish.notify:  # told a generation that leaves them out: they exit at their next check
            w = self.workers[worker_id]
            if worker_id not in publish.plan and w.running:
                w.exited = True
                self.pending.append(m.WorkerExited(worker_id, Removed()))

    # ---- the shell's random behaviour ------------------------------------------------------------
    def step(self) -> None:
        """One random happening; its messages join the pending ones."""
        rng = self.rng
        choices = [
            (self._boot, 8),
            (self._sync, 5),
            (self._train, 4),
            (self._die, 1),
            (self._discover, 3),
            (self._paces, 2),
            (self._finish, 1),
            (self._ring_error, 1),
            (self._raise, 0.5),
            (self._answer, 2),
            (self._hang, 1),
            (self._drain, 1),
            (self._kv_restart, 1),
            (self._note, 1),
            (self._end, 0.05),
        ]
        pick = rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]
        pick()

    def _running(self) -> list[str]:
        return [w for w, rec in self.workers.items() if rec.running]

    def _finishing(self, worker_id: str) -> bool:
        return self.finish is not None and worker_id in self.finish.plan

    def _boot(self) -> None:
        booting = [w for w, rec in self.workers.items() if rec.running and not rec.never_boots and rec.progress is None]
        for w in self.rng.sample(booting, min(len(booting), self.rng.randint(1, 2))):
            self.pending.append(m.WorkerReady(w))

    def _sync(self) -> None:
        """The newest generation's ring forms, if every member runs: each takes rank 0's state."""
        g, plan = self.generation, self.plan
        if not g or g in self.ring_synced or not all(self.workers[w].running for w in plan):
            return
        rank0 = next(w for w, slot in plan.items() if slot.rank == 0)
        if g in self.resumed:  # rank 0 loaded the durable checkpoint before its first sync, and says so
            self.workers[rank0].progress = self.run_progress = self.durable or 0
            meta = {"commit": self.durable or 0, "written_at": 1000.0, "world_size": 2}
            if self.rng.random() < 0.3:
                meta["reason"] = "resharding lost rows (both holders of rank 1's rows were lost)"
            self.pending.append(m.WorkerResumed(rank0, meta))
        state = self.workers[rank0].progress or 0  # generation 1's rank 0 starts the run's state: commit 0
        self.run_progress = max(self.run_progress, state)
        self.ring_synced.add(g)
        for w in plan:
            self.workers[w].progress = state
            self.pending.append(m.WorkerSynced(w, g, self.now + 1000.0, state))

    def _trains(self) -> bool:
        g = self.generation
        return g in self.ring_synced and all(self.workers[w].running for w in self.plan) and self.finish is None

    def _train(self) -> None:
        """The current ring commits once; rank 0 writes a durable checkpoint sometimes."""
        if not self._trains():
            return
        self.trained.add(self.generation)
        for w in self.plan:
            self.workers[w].progress = (self.workers[w].progress or 0) + 1
        self.run_progress = max(self.workers[w].progress or 0 for w in self.plan)
        if self.config.checkpoint_dir is not None and self.rng.random() < 0.3:
            self.durable = self.run_progress

    def _die(self) -> None:
        running = [w for w in self._running() if not self._finishing(w)]
        if not running:
            return
        victim = self.rng.choice(running)
        node_lost = self.rng.random() < 0.1
        victims = [w for w in running if self.workers[w].host == self.workers[victim].host] if node_lost else [victim]
        if node_lost:
            self.offered.pop(self.workers[victim].host, None)
        for w in victims:
            self.workers[w].alive = False
            if self.rng.random() < 0.5:  # it died before its last words left: they never come (a ring that
                # trained after its sync had the words sent already)
                self.pending = [
                    x
                    for x in self.pending
                    if not (isinstance(x, _SAID) and x.worker_id == w)
                    or (isinstance(x, m.WorkerSynced) and x.generation in self.trained)
                ]
            self.pending.append(m.WorkerDied(w, "SIGKILL", node_alive=not node_lost))
        for w in self.plan:  # the survivors' rings break
            if self.workers[w].running and w not in victims and self.rng.random() < 0.3:
                self.pending.append(m.ResetRequested(w, self.generation, "Connection closed by peer"))

    def _discover(self) -> None:
        rng, offered = self.rng, self.offered
        r = rng.random()
        if r < 0.25 and offered:
            offered.pop(rng.choice(sorted(offered)))
        elif r < 0.6:
            host = rng.choice(POOL)
            offered[host] = rng.choice((1, 2))
        elif r < 0.7:
            self.pending.append(m.HostsDiscovered({}))  # a blip: one poll offers nothing
        self.pending.append(m.HostsDiscovered(dict(offered)))

    def _paces(self) -> None:
        """A full window of every member's pace, one of them slow: the core may let it go."""
        if not self._trains() or len(self.plan) < 2:
            return
        slow = self.rng.choice(sorted(self.plan))
        for w in self.plan:
            compute = 0.03 * (3.0 if w == slow else 1.0)
            window = tuple(PaceSummary(self.generation, 0.0, 1.5, 40, 40 * compute, 40 * 0.005) for _ in range(WINDOW))
            self.pending.append(m.PacesReported(w, window))

    def _finish(self) -> None:
        if not self._trains() or self.run_progress <= 0:
            return
        members = sorted(self.plan)
        uneven = self.rng.choice(members[1:] or [None]) if self.rng.random() < 0.2 else None
        if uneven is not None and self.plan[uneven].rank == 0:
            uneven = None
        self.finish = Finish(self.generation, dict(self.plan), uneven, f"rank 0's value (seed {self.seed})")
        for w, slot in self.plan.items():
            if w == uneven:
                continue
            self.workers[w].exited = True
            value = self.finish.value if slot.rank == 0 else None
            self.pending.append(m.WorkerExited(w, Finished(slot.rank, value, generation=self.generation)))
        if uneven is not None:  # its ring breaks once the others returned
            self.finish.broke_in.add(self.generation)
            self.pending.append(m.ResetRequested(uneven, self.generation, "Connection closed by peer"))

    def _ring_error(self) -> None:
        """A member's ring breaks with everyone alive (a timeout): the core asks everyone what it is doing."""
        members = [w for w in self.plan if self.workers[w].running and not self._finishing(w)]
        if members:
            self.pending.append(m.ResetRequested(self.rng.choice(members), self.generation, "timed out"))

    def _raise(self) -> None:
        """Members' train_fn raise in this generation (one, or several): they stay, waiting to re-enter."""
        members = [w for w in self.plan if self.workers[w].running and not self._finishing(w)]
        for w in self.rng.sample(members, min(len(members), self.rng.choice((1, 1, 2)))):
            if self.rng.random() < 0.8:  # inside @elastic.run: it stays to re-enter
                self.pending.append(m.TrainFnRaised(w, self.generation, "RuntimeError: intended", "Traceback ..."))
            else:  # out of train_fn itself: its run() returns the error, the driver replaces it if retries allow
                self.workers[w].exited = True
                self.pending.append(m.WorkerExited(w, UserError("RuntimeError: intended", "Traceback ...")))

    def _note(self) -> None:
        """What the shell or a rank tells that changes no membership: a slow dataset block, another backend."""
        if self.rng.random() < 0.5:
            self.pending.append(m.DataSlow("train", self.rng.randint(0, 99), 30.0))
        elif self.plan:
            self.pending.append(m.BackendNote("ranks share a GPU: their ring runs Gloo with host staging"))

    def _end(self) -> None:
        """What ends the run from outside the core: the user, the shell's own error, Ray, the KV actor, discovery."""
        rng = self.rng
        choices = [
            m.Stop("stopped by the user"),
            m.DriverFailed("the GCS did not take the driver's snapshot"),
            m.DiscoveryFailed("discover.sh exited with status 1"),
            m.KVLost("the run's KV actor died for good"),
            m.PublishFailed(self.generation, "the KV actor did not answer"),
            m.SnapshotRefused("an older snapshot than the run's"),
        ]
        starting = [w for w, rec in self.workers.items() if rec.running and rec.progress is None]
        if starting:
            choices.append(m.WorkerStartFailed(rng.choice(starting), "Ray refused the runtime_env"))
        self.pending.append(rng.choice(choices))

    def _answer(self) -> None:
        """A question out is answered: the members' activity, or the checkpoint lookup (late, possibly)."""
        rng = self.rng
        if self.queries and rng.random() < 0.6:
            q = self.queries.pop(0)
            activity: dict[str, Any] = {}
            for w in q.worker_ids:
                rec = self.workers[w]
                if not rec.running:
                    activity[w] = m.ACTIVITY_ERROR if not rec.alive or rng.random() < 0.7 else m.ACTIVITY_TIMEOUT
                else:  # in a collective, stuck outside one (user code), or too busy to answer in time
                    activity[w] = rng.choice(
                        (
                            {"idle_s": 0.1, "in_collective": True},
                            {"idle_s": 0.1, "in_collective": True},
                            {"idle_s": 30.0, "in_collective": False},
                            m.ACTIVITY_TIMEOUT,
                        )
                    )
            self.pending.append(m.ActivityReport(q.generation, q.requester, q.reason, activity))
        elif self.lookups:
            self.lookups -= 1
            if rng.random() < 0.1:
                self.pending.append(m.CheckpointFound(False, error="storage did not answer"))
            else:
                self.pending.append(m.CheckpointFound(self.durable is not None))

    def _hang(self) -> None:
        """A member stops answering pings and uses no CPU: the core kills it as hung."""
        members = [w for w in self.plan if self.workers[w].running and not self._finishing(w)]
        if not members:
            return
        rng = self.rng
        w = rng.choice(members)
        answered = frozenset(x for x in self._running() if x != w)
        kind = rng.choice(("hung", "hung", "busy", "unreadable", "cut off"))
        if kind == "busy":  # a long C call holding the GIL: it computes, and answers the next round
            sample: m.CpuSample | str = m.CpuSample(0.5, 0.5, "R")
        else:
            self.workers[w].hung = True
            sample = {"hung": m.CpuSample(0.0, 0.5, "S"), "unreadable": "the reading timed out"}.get(
                kind, "its node did not answer (cut off)"
            )
        self.pending.append(m.PingResults(answered, frozenset({w}), self.now - 5.0, {w: sample}))
        if kind == "busy":
            self.pending.append(m.PingResults(frozenset(self._running()), frozenset(), self.now, {}))

    def _drain(self) -> None:
        """Ray drains a node (a preemption notice): its workers leave gracefully; discovery may drop it later."""
        hosts = sorted({self.workers[w].host for w in self._running()} - self.draining)
        if self.draining and self.rng.random() < 0.25:  # a drain cancelled (`ray drain-node` undone)
            self.draining.discard(self.rng.choice(sorted(self.draining)))
            self.pending.append(m.NodesDraining(dict.fromkeys(sorted(self.draining), 0.0)))
        elif hosts:
            self.draining.add(self.rng.choice(hosts))
            self.pending.append(m.NodesDraining(dict.fromkeys(sorted(self.draining), 0.0)))

    def _kv_restart(self) -> None:
        """The KV actor died and Ray restarted it, empty."""
        self.pending.append(m.KVRestarted("model"))

    # ---- delivering --------------------------------------------------------------------------------
    def batch(self) -> list[m.Message]:
        """Some pending messages, reordered, one maybe duplicated (Ray may deliver a call twice)."""
        rng = self.rng
        if not self.pending:
            return [m.Tick()]
        n = rng.randint(1, min(4, len(self.pending)))
        picked = rng.sample(range(len(self.pending)), n)
        out = [self.pending[i] for i in picked]
        for i in sorted(picked, reverse=True):
            del self.pending[i]
        # the shell's liveness rounds come one after another, each once: the earliest pending ones first, in order
        rounds = [x for x in out if isinstance(x, m.PingResults)]
        if rounds:
            waiting = sorted((x for x in self.pending + rounds if isinstance(x, m.PingResults)), key=_sent_at)
            taken, self.pending = waiting[: len(rounds)], [x for x in self.pending if x not in waiting[: len(rounds)]]
            self.pending += [x for x in rounds if x not in taken]
            slots = iter(taken)
            out = [next(slots) if isinstance(x, m.PingResults) else x for x in out]
        if self.delivered and rng.random() < 0.1:  # Ray may deliver a call twice (not the shell's own rounds)
            again = [x for x in self.delivered[-20:] if not isinstance(x, m.PingResults)]
            if again:
                out.insert(rng.randrange(len(out) + 1), rng.choice(again))
        if rng.random() < 0.3:
            out.append(m.Tick())
        return out

    def deliver(self, messages: list[m.Message], after: float, may_die: bool = True) -> list[m.Action]:
        core = self.core
        self.now += after
        # the stragglers let go that were already on their way out before this batch
        evicted = {w for w in core.record.evicted if _status(core, w) is WorkerStatus.LEAVING}
        final = core.state.is_final
        self.log.append(f"t={self.now:.2f} {[_short(x) for x in messages]}")
        self.raised_in.update(x.generation for x in messages if isinstance(x, m.TrainFnRaised))
        # a raise out of train_fn counts for the generation current when its word arrives
        if any(isinstance(x, m.WorkerExited) and isinstance(x.outcome, UserError) for x in messages):
            self.raised_in.add(core.generation)
        actions = core.handle(messages, self.now)
        self.log.append(f"  -> {actions}")
        self.final_before = final
        self.delivered.extend(x for x in messages if not isinstance(x, m.Tick))
        self.kinds_delivered.update(type(x) for x in messages)
        dies = may_die and not core.state.is_final and self.rng.random() < 0.03
        # the driver may die after its snapshot, having carried out some, all or none of the batch's actions
        self.act(actions[: self.rng.randint(0, len(actions))] if dies else actions)
        self.check_batch(messages, actions, evicted)
        if dies:
            self.restart_driver(reattach=True)
        return actions

    def restart_driver(self, reattach: bool = False) -> None:
        """The driver actor restarts from its snapshot: the round trip changes nothing, and it asks again.

        With `reattach` (it died before carrying out all of its last actions),
        its shell finds the workers again as `WorkerPool.reattach` does: a
        start cut short is started now, a worker gone is reported dead, and
        one the core no longer counts (a kill that never happened) is removed.
        """
        copy = pickle.loads(pickle.dumps(self.core))
        self.require(fingerprint(copy) == fingerprint(self.core), "the snapshot round trip changed the core")
        self.core = copy
        self.now += 2.0
        self.log.append(f"t={self.now:.2f} driver restarted" + (" before its last actions" if reattach else ""))
        actions = self.core.restarted(self.now, "model")
        if reattach:
            alive = set(self.core.alive_ids())
            for w in sorted(alive):
                rec = self.core.workers[w]
                if w not in self.workers:
                    if rec.status is WorkerStatus.STARTING:
                        actions.append(m.Spawn(w, rec.host))
                    else:
                        self.pending.append(m.WorkerDied(w, "gone when the restarted driver looked", True))
            for w, truth in self.workers.items():
                if w not in alive and truth.alive:
                    truth.alive = False  # the run's actors the core no longer counts are removed
        self.act(actions)
        self.deliver([m.Tick()], after=0.0, may_die=False)  # the restarted loop's first batch, at its own time

    def stale_word(self) -> None:
        """A void worker (dead, killed, let go) speaks: nothing it says may change the run."""
        void = [w for w in self.workers if self.core.is_void(w)]
        if not void or self.core.state.is_final:
            return
        w = self.rng.choice(void)
        g = self.core.generation
        said = self.rng.choice(
            [
                m.WorkerReady(w),
                m.WorkerSynced(w, g, self.now + 1000.0, 99),
                m.ResetRequested(w, g, "Connection closed by peer"),
                m.ActivityReport(g, w, "timed out", {w: "timeout"}),
                m.WorkerExited(w, Finished(0, "a void worker's value", generation=g)),
                m.WorkerDied(w, "late", True),
            ]
        )
        before = fingerprint(self.core)
        actions = self.core.handle([said], self.now)
        self.log.append(f"t={self.now:.2f} void {said} -> {actions}")
        self.require(not actions and fingerprint(self.core) == before, f"void worker {w}'s {said} changed the run")

    # ---- the invariants ----------------------------------------------------------------------------
    def require(self, ok: bool, what: str) -> None:
        if not ok:
            core = self.core
            tail = "\n".join(line for line in self.log if line != "  -> []" and not line.endswith("[Tick()]"))
            statuses = {w: (r.status.value, r.holds_state) for w, r in core.workers.items()}
            truth = {w: (w_.host, w_.running, w_.progress) for w, w_ in self.workers.items()}
            raise Violation(
                f"seed {self.seed}: {what}\n  config: min {self.config.min_workers}, max {self.config.max_workers}, "
                f"checkpoint {self.config.checkpoint_dir}\n  core: {core.state.value} generation {core.generation} "
                f"plan {sorted(core.plan)} syncing {sorted(core.generations.syncing)} {statuses}\n"
                f"  truth: {truth} run progress {self.run_progress}\n  script:\n{tail[-6000:]}"
            )

    def check_batch(self, messages: list[m.Message], actions: list[m.Action], evicted: set[str]) -> None:
        core = self.core
        for publish in (a for a in actions if isinstance(a, m.Publish)):
            self.check_publish(publish)
        self.check_fenced(actions)
        self.check_failure()
        self.check_min_workers(evicted)
        self.check_finish(messages, {a.worker_id for a in actions if isinstance(a, m.Kill) and a.failed})
        spares = core.record.roster.count(*SPARES)
        self.require(spares <= self.config.spares, f"{spares} hot spares, more than spares={self.config.spares}")
        if core.state is DriverState.RESETTING or core.state is DriverState.RUNNING:
            resetting = core.generation > 1 and bool(core.generations.syncing)
            self.require((core.state is DriverState.RESETTING) == resetting, "the phase disagrees with the syncs")

    def check_publish(self, publish: m.Publish) -> None:
        """A published plan: rank 0 holds the newest commit (or the run resumed from the durable checkpoint),
        no member is gone or let go, and the world is not below min_workers."""
        rank0 = next(w for w, slot in publish.plan.items() if slot.rank == 0)
        progress = self.workers[rank0].progress
        held = -1 if progress is None else progress  # never received the run's state
        # a generation that resumes from the durable checkpoint (its publish may be carried out only later, by a
        # restarted driver, when the one that decided it died first)
        resumes = (
            publish.generation in self.resumed
            or any(e.kind is EventKind.RESTARTED and e.generation == publish.generation for e in self.core.events)
            or (self.generation in self.resumed and self.generation not in self.ring_synced)  # carried on
        )
        self.require(
            held == self.run_progress or resumes or self.run_progress <= 0 <= held + 1,
            f"generation {publish.generation}'s rank 0 {rank0} holds commit {held}, the run's newest is "
            f"{self.run_progress}",
        )
        for w in publish.plan:
            self.require(not self.core.is_void(w), f"generation {publish.generation} names void worker {w}")
            self.require(self.core.workers[w].status in ALIVE, f"generation {publish.generation} names ended {w}")
            self.require(self.core.workers[w].status not in SPARES, f"generation {publish.generation} names spare {w}")
        # one over max_workers only while a holder hands the state over to a newcomer (`Scaling._room_for`)
        self.require(
            len(publish.plan) <= self.config.max_workers + 1,
            f"generation {publish.generation} has {len(publish.plan)} members, max_workers={self.config.max_workers}",
        )
        self.require(
            len(publish.plan) >= self.config.min_workers,
            f"generation {publish.generation} has {len(publish.plan)} < min_workers members",
        )

    def check_fenced(self, actions: list[m.Action]) -> None:
        """A worker stopped by the core (let go or killed as failed) is void from then on."""
        for kill in (a for a in actions if isinstance(a, m.Kill)):
            rec = self.core.workers.get(kill.worker_id)
            if rec is not None and rec.status is not WorkerStatus.FINISHED and not self.core.state.is_final:
                self.require(self.core.is_void(kill.worker_id), f"{kill.worker_id} was stopped but is not fenced")

    def check_failure(self) -> None:
        """Every member lost is said only when no member the core knows to hold the newest state lives.

        And a raise fails the run only when it is an attempt beyond `max_failures` (or ranks finish unevenly).
        """
        failure = self.core.failure
        if failure is not None and failure.startswith("train_fn raised in worker") and "Traceback ..." in failure:
            self.require(
                0 <= self.config.max_failures < len(self.raised_in) or self.finish is not None,
                f"a raise failed the run after {len(self.raised_in)} raising attempts, "
                f"max_failures={self.config.max_failures}",
            )
        if failure is None or not any(text in failure for text in _ALL_LOST):
            return
        for w in self.core.plan:
            rec, truth = self.core.workers.get(w), self.workers[w]
            alive_holder = rec is not None and rec.holds_state and rec.status in ALIVE and truth.running
            self.require(
                not (alive_holder and truth.progress == self.run_progress),
                f"the run failed as every holder lost while {w} holds the state and runs: {failure}",
            )

    def check_min_workers(self, leaving_before: set[str]) -> None:
        """The core's own decisions never take the world below min_workers: stragglers sent on their way out in
        this batch (let go in it or earlier) leave at least min_workers members that stay (not on a draining or
        withdrawn host: those members leave too), unless the world was below it without the stragglers leaving."""
        core = self.core
        # the stragglers that started leaving in this batch, whose hosts stay offered (a withdrawn one leaves anyway)
        evicted = {
            w
            for w in core.record.evicted - leaving_before
            if _status(core, w) is WorkerStatus.LEAVING and core.workers[w].host in core.record.hosts
        }
        if evicted and not core.state.is_final and not core.finishing.active:
            staying = [
                w
                for w in core.plan
                if core.workers[w].status is WorkerStatus.MEMBER
                and core.workers[w].host not in core.record.draining
                and core.workers[w].host in core.record.hosts
            ]
            self.require(
                len(staying) >= self.config.min_workers or len(staying) + len(evicted) < self.config.min_workers,
                f"letting {sorted(evicted)} go leaves {len(staying)} < min_workers members that stay",
            )

    def check_finish(self, messages: list[m.Message], killed: set[str]) -> None:
        """Ranks that all return end the run DONE with rank 0's value; an uneven finish fails at once, keeping it.

        A rank the core killed as failed in the batch that carried its return
        was judged before the return reached it (a return first would have
        ended it, and a finished worker is not killed): that return is void.
        """
        fin, core = self.finish, self.core
        if fin is None:
            return
        for x in messages:
            if isinstance(x, m.WorkerExited) and x.worker_id in killed:
                continue
            if isinstance(x, m.WorkerExited) and x.worker_id in fin.plan and not core.state.is_final:
                fin.said.add(x.worker_id)
            if isinstance(x, m.WorkerExited) and x.worker_id in fin.plan and fin.plan[x.worker_id].rank == 0:
                fin.rank0_said = fin.rank0_said or not (core.is_void(x.worker_id) or self.final_before)
            # the uneven rank's own exit first (drained or withdrawn: it leaves once its ring broke) ended every
            # member, so the run ended DONE before its ring error could tell an uneven finish: nothing was lost
            left_first = any(isinstance(y, m.WorkerExited) and y.worker_id == fin.uneven for y in fin.exits)
            if isinstance(x, m.ResetRequested) and x.worker_id == fin.uneven and len(fin.said) > 0 and not left_first:
                self.require(core.state is DriverState.FAILED, "an uneven finish did not fail at once")
            if isinstance(x, m.WorkerExited):
                fin.exits.append(x)
        if fin.rank0_said and core.state.is_final and core.failure is None:
            self.require(core.return_value == fin.value, f"the run ended DONE without rank 0's value: {core.failure}")
        if fin.uneven is not None and core.state is DriverState.FAILED and "same step" in (core.failure or ""):
            if fin.rank0_said:
                self.require(core.return_value == fin.value, "an uneven finish dropped rank 0's value")
        # the run ends once the last member ends: a leaver's exit may still be on its way
        ending = any(isinstance(x, (m.WorkerExited, m.WorkerDied)) for x in self.pending)
        if fin.uneven is None and fin.said >= set(fin.plan) and core.failure is None and not ending:
            self.require(core.state is DriverState.DONE, "every rank returned but the run is not done")
            self.require(core.return_value == fin.value, "the run ended without rank 0's value")

    # ---- the end: nothing waits for ever ---------------------------------------------------------------
    def settle(self) -> None:
        """Deliver everything, answer everything, boot everyone, let time pass every deadline: the run must end
        or train on a whole generation, with nobody left waiting to be admitted."""
        if self.rng.random() < 0.5:  # the cluster recovers: discovery offers every host again
            self.offered = {h: 2 for h in POOL}
            self.pending.append(m.HostsDiscovered(dict(self.offered)))
        finish = self.rng.random() < 0.5  # the ranks return once they trained
        for _ in range(60):
            if self.core.state.is_final:
                return
            if finish and self.finish is None and self.generation in self.ring_synced:
                self._train()
                self._finish()
            fin = self.finish
            if fin is not None and fin.uneven is not None and self.generation not in fin.broke_in:
                # the rank that did not return joins each new generation, whose ring never forms without the others
                fin.broke_in.add(self.generation)
                self.pending.append(m.ResetRequested(fin.uneven, self.generation, "timed out waiting for rank 0"))
            for w, rec in self.workers.items():
                if rec.running and not rec.never_boots and rec.progress is None and w not in self.plan:
                    self.pending.append(m.WorkerReady(w))
            self._sync()
            while self.queries or self.lookups:
                self._answer()
            # the shell's liveness round goes on: a hung worker misses every one, using no CPU
            hung = frozenset(w for w, r in self.workers.items() if r.alive and r.hung and not r.exited)
            answered = frozenset(self._running())
            silent = dict.fromkeys(hung, m.CpuSample(0.0, 0.5, "S"))
            self.pending.append(m.PingResults(answered, hung, self.now, silent))
            batch, self.pending = self.pending + [m.Tick()], []
            rounds = sorted((x for x in batch if isinstance(x, m.PingResults)), key=_sent_at)
            batch = rounds + [x for x in batch if not isinstance(x, m.PingResults)]
            self.deliver(batch, after=5.0)
        core = self.core
        self.require(core.state is DriverState.RUNNING, f"the run still waits in {core.state.value}")
        self.require(not core.generations.syncing, "the run waits for a sync that cannot come")
        roster = core.record.roster
        ready = roster.ids(WorkerStatus.READY, WorkerStatus.MEMBER)
        self.require(
            set(core.plan) == ready,
            f"workers wait to be admitted for ever: plan {sorted(core.plan)}, ready {sorted(ready)}",
        )
        self.require(
            not roster.any(WorkerStatus.SPARE)
            or len(core.plan) + roster.count(WorkerStatus.STARTING) >= self.config.max_workers,
            f"a ready spare waits while the world ({len(core.plan)}) is below max_workers={self.config.max_workers}",
        )


def _status(core: DriverCore, worker_id: str) -> WorkerStatus | None:
    """A worker's status, or None once the core forgot it (a durable restart drops the old roster)."""
    rec = core.workers.get(worker_id)
    return None if rec is None else rec.status


def _sent_at(msg: m.PingResults) -> float:
    return msg.sent_at


def _short(msg: m.Message) -> str:
    """A message for the script's log (a pace window as its worker and compute per step)."""
    if isinstance(msg, m.PacesReported):
        return f"Paces({msg.worker_id}, g{msg.paces[0].generation}, {msg.paces[0].compute_per_step * 1000:.0f} ms)"
    return repr(msg)


def fingerprint(core: DriverCore) -> tuple:
    """What the run's decisions rest on, comparable: a snapshot or a void word must leave it as it is."""
    workers = tuple((w, r.status, r.holds_state, r.host) for w, r in sorted(core.workers.items()))
    return (
        core.state,
        core.generation,
        tuple(sorted(core.plan.items())),
        core.failure,
        repr(core.return_value),
        len(core.events),
        workers,
        tuple(sorted(core.generations.syncing)),
        tuple(sorted(core.record.evicted)),
        tuple(sorted(core.record.hosts.items())),
        tuple(sorted(core.record.roster.fenced)),
    )


def play(seed: int, steps: int = 30) -> Model:
    """One script: `steps` random happenings, each followed by a batch, then the settling. Raises `Violation`."""
    model = Model(seed, steps)
    rng = model.rng
    model.deliver(model.batch(), after=0.5)
    for _ in range(steps):
        if model.core.state.is_final:
            break
        model.step()
        r = rng.random()
        if r < 0.04:
            model.restart_driver()
        elif r < 0.08:
            model.stale_word()
        after = rng.choice((0.01, 0.5, 2.0, 2.0, 7.0)) if rng.random() < 0.985 else 70.0
        model.deliver(model.batch(), after=after)
    model.settle()
    return model


def quiet() -> None:
    """The core logs every decision; thousands of scripts need none of it."""
    logging.getLogger("ray_elastic.driver").setLevel(logging.CRITICAL)
