"""The driver's durability: its snapshot in the GCS, and calls answered only once a snapshot holds them.

The driver survives its own death. Ray restarts the actor (`max_restarts`)
and sends it again the calls it had not answered (`max_task_retries`). So
after every batch the driver writes its core to a snapshot (`snapshot.py`)
before it carries the batch's actions out, and answers a worker's call only
once that call's message is in a snapshot: a call a dead driver answered is
one its successor knows of. Metrics batches carry sequence numbers, so one
sent again after a restart counts once (`MetricSeqs`: only the batches that
carried reports, a handful of workers). A batch that changes nothing a
restarted driver needs writes nothing (`DurableChanges`): the ranks' pace
summaries, a tick, a liveness round where every member answered. Every wait of a restarted
driver on the GCS or the KV actor is bounded by `KV_BACK_S` and, past it,
names what it waited for (`NoAnswerError`).
"""

from __future__ import annotations

import asyncio
import functools
import pickle
from typing import TYPE_CHECKING, Any, NamedTuple

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.shell import snapshot
from ray_elastic.driver.shell.worker_pool import first_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.auth import RunToken

KV_BACK_S = 60.0  # how long the GCS or a restarting KV actor may take to answer


class NoAnswerError(Exception):
    """A restarted driver's bounded wait ran out; the message names what it waited for."""


async def within(what: str, awaitable: Any) -> Any:
    """`awaitable`, within `KV_BACK_S`; else `NoAnswerError` saying the driver could not `what`."""
    try:
        return await asyncio.wait_for(awaitable, KV_BACK_S)
    except asyncio.TimeoutError as e:
        raise NoAnswerError(f"the run's driver could not {what} within {KV_BACK_S:g} s; the run cannot go on") from e


class Seqs:
    """The sequence numbers seen, as every number up to `floor` and the ones above it (a few at most).

    A sender has one batch in flight at a time, so a number more than
    `SPAN` below the newest is never coming (a batch that was not recorded:
    one without reports): the floor moves past such gaps, which keeps
    `above` small.
    """

    SPAN = 64

    def __init__(self) -> None:
        self.floor = 0
        self.above: set[int] = set()

    def add(self, seq: int) -> bool:
        """Note `seq`; False if it was seen before."""
        if seq <= self.floor or seq in self.above:
            return False
        self.above.add(seq)
        if len(self.above) > self.SPAN:
            self.floor = max(self.floor, max(self.above) - self.SPAN)
            self.above = {s for s in self.above if s > self.floor}
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.discard(self.floor)
        return True


class MetricSeqs:
    """The numbers of the metrics batches taken that carried reports, per worker; `version` counts them.

    Only such a batch changes what a restarted driver must not take twice
    (the reports `fit()` gets): a batch of pace summaries alone, sent again
    after a restart, is taken again and counts for nothing durable (the
    windows start empty in a restarted driver). So the workers that never
    reported (every rank but rank 0, at any scale) have no entry, and the
    snapshot holds a few.
    """

    def __init__(self) -> None:
        self._seen: dict[str, Seqs] = {}
        self.version = 0

    def take(self, worker_id: str, seq: int, reports: bool) -> bool:
        """Whether the batch `seq` of `worker_id` is taken (False: taken before); `reports`: it carries some."""
        if not reports:
            return True
        seen = self._seen.get(worker_id)
        if seen is None:
            seen = self._seen[worker_id] = Seqs()
        if not seen.add(seq):
            return False
        self.version += 1
        return True

    def forget(self, worker_id: str) -> None:
        self._seen.pop(worker_id, None)

    def __len__(self) -> int:
        return len(self._seen)


class DurableChanges:
    """Whether a batch changed anything a restarted driver needs, so the core must be written again.

    Ticks and the ranks' pace summaries never do by themselves (what they
    decide comes with actions, or with an event the next batch writes); a
    liveness round does only when a member missed it or answers again
    after missing one (the core's record of its silence); discovery, every
    `discovery_interval`, only when it offers other hosts than its last
    poll. The members silent so far are followed here from the rounds
    themselves, so telling costs the round's misses, not its members.
    """

    def __init__(self) -> None:
        self._silent: set[str] = set()
        self._offered: Any = None  # the hosts discovery's last poll offered

    def seen(self, batch: list[Any], actions: list[Any]) -> bool:
        changed = bool(actions)
        for msg in batch:
            if isinstance(msg, m.PingResults):
                if msg.timed_out or any(w in msg.answered for w in self._silent):
                    changed = True
                self._silent = set(msg.timed_out)  # one silent before and in neither list now is gone
            elif isinstance(msg, m.HostsDiscovered):
                if msg.hosts != self._offered:
                    changed = True
                    self._offered = msg.hosts
            elif not msg.quiet:
                changed = True
        return changed


class Received(NamedTuple):
    """A message from a call; the call is answered once a snapshot holds it (`seq`)."""

    seq: int
    message: Any  # None: nothing for the core (add_metrics changed the metrics log)


class CallLedger:
    """The calls waiting for a snapshot, and the snapshot last written."""

    def __init__(self, run_id: str, token: RunToken) -> None:
        self.run_id = run_id
        self.token = token
        self.received = 0  # calls' messages queued so far
        self.in_batch = 0  # the newest of them in the batch being applied
        self.durable = 0  # the newest of them a snapshot holds
        self.answers: list[tuple[int, asyncio.Future]] = []  # calls waiting for their message's snapshot
        self._snapshot: bytes | None = None
        # the core as last pickled, reused while it has not changed: the pickle, and its large parts out of band
        self._core_blob: tuple[bytes, list[memoryview]] | None = None
        self._parts: dict[int, tuple[str, bytes]] = {}  # the parts the GCS holds, by their bytes' id: name, bytes
        self._stale: set[str] = set()  # parts of a loaded snapshot: deleted once one of this driver is written
        self.written = 0  # the write counter of the newest snapshot (a restarted driver goes on from its own)
        # told each counter written (the driver sends it to the KV actor, which a restart asks: `judge_snapshot`)
        self.confirm: Callable[[int], None] | None = None

    def receive(self, message: Any) -> tuple[Received, asyncio.Future]:
        """A call's message to queue, and the future answered once a snapshot holds it."""
        self.received += 1
        fut = asyncio.get_running_loop().create_future()
        self.answers.append((self.received, fut))
        return Received(self.received, message), fut

    def unwrap(self, raw: list[Any]) -> list[Any]:
        """The messages of `raw`; calls' messages are noted, to be answered once snapshotted."""
        out = []
        for x in raw:
            if isinstance(x, Received):
                self.in_batch = max(self.in_batch, x.seq)
                if x.message is not None:
                    out.append(x.message)
            else:
                out.append(x)
        return out

    async def persist(
        self, core: Any, rest: tuple[Any, ...], core_changed: bool = True, rest_changed: bool = True
    ) -> str | None:
        """Write the core and `rest` (if they changed), then answer the calls they hold; or why the GCS refused.

        Pickled on the loop, so it is one moment's state: the core only when
        it changed, the rest (the metrics: a few reports) when it changed; a
        thread would not help, pickling holds the GIL. The core's large parts
        (the roster's columns, a plan's members: bytes it keeps while they do
        not change) go out of band: the loop neither copies them nor, once
        the GCS holds one, writes it again (`snapshot.save`'s parts). When
        nothing changed nothing is written: the last snapshot holds every
        call's effect. Written to the GCS off the loop, within `KV_BACK_S`.
        """
        durable = self.in_batch
        if not core_changed and not rest_changed and self._snapshot is not None:
            self._answer(durable)
            return None
        if core_changed or self._core_blob is None:
            buffers: list[pickle.PickleBuffer] = []
            main = pickle.dumps(core, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=buffers.append)
            self._core_blob = (main, [b.raw() for b in buffers])
        main, parts = self._core_blob
        counter = self.written + 1
        names, new = self._name_parts(parts, counter)
        blob = pickle.dumps((main, names, *rest), protocol=pickle.HIGHEST_PROTOCOL)
        if blob != self._snapshot:
            loop = asyncio.get_running_loop()
            kept = {id(p.obj) for p in parts}
            stale = self._stale | {name for key, (name, _) in self._parts.items() if key not in kept}
            save = functools.partial(snapshot.save, self.run_id, counter, blob, self.token, new, stale)
            try:
                await asyncio.wait_for(loop.run_in_executor(None, save), KV_BACK_S)
            except Exception as e:  # noqa: BLE001 - a GCS that is down or slow: the run cannot be made durable
                return f"no answer within {KV_BACK_S:g} s" if isinstance(e, asyncio.TimeoutError) else first_line(e)
            self._snapshot, self.written, self._stale = blob, counter, set()
            self._parts = {id(p.obj): (names[i], p.obj) for i, p in enumerate(parts)}  # type: ignore[misc]
            if self.confirm is not None:
                self.confirm(counter)
        self._answer(durable)
        return None

    def _name_parts(self, parts: list[memoryview], counter: int) -> tuple[list[str], dict[str, memoryview]]:
        """Each part's name (the one the GCS holds it under, or a new one for write `counter`), and the new ones."""
        names: list[str] = []
        new: dict[str, memoryview] = {}
        for part in parts:
            held = self._parts.get(id(part.obj))
            if held is not None and held[1] is part.obj:
                names.append(held[0])
                continue
            name = next((n for n, p in new.items() if p.obj is part.obj), None) or f"{counter}.{len(new)}"
            new[name] = part
            names.append(name)
        return names, new

    def _answer(self, durable: int) -> None:
        """The calls whose messages are up to `durable`, which a snapshot now holds."""
        self.durable = durable
        waiting, self.answers = self.answers, []
        for seq, fut in waiting:
            if seq <= self.durable:
                if not fut.done():
                    fut.set_result(None)
            else:
                self.answers.append((seq, fut))

    def answer_all(self) -> None:
        """The run ended: nothing more will be snapshotted; answer every call still waiting."""
        for _, fut in self.answers:
            if not fut.done():
                fut.set_result(None)
        self.answers = []

    async def load(self) -> tuple[Any, ...] | None:
        """The last snapshot: (the core, *rest), or None if none was written (`ForgedSnapshotError` if forged).

        Its write counter becomes `written`: the next snapshot follows it.
        """
        loop = asyncio.get_running_loop()
        saved = await within(
            "load its snapshot from the GCS", loop.run_in_executor(None, snapshot.load, self.run_id, self.token)
        )
        if saved is None:
            return None
        self.written, (main, names, *rest) = saved
        parts = await within(
            "load its snapshot's parts from the GCS",
            loop.run_in_executor(None, lambda: {n: snapshot.load_part(self.run_id, n, self.token) for n in set(names)}),
        )
        self._stale = set(names)  # this driver writes its own parts: the loaded ones go with its first snapshot
        return (pickle.loads(main, buffers=[parts[n] for n in names]), *rest)  # covered by the signatures


def judge_snapshot(counter: int, generation: int, confirmed: int, kv_generation: int) -> str | None:
    """None if a restarted driver may resume from its snapshot (write `counter`, of `generation`); else why not.

    The driver writes its snapshot before it publishes a generation and
    confirms each write to the KV actor after it (`confirmed`, the newest
    it heard of). A snapshot older than either was written back by someone:
    resuming from it would bring back membership that no longer exists.
    A KV actor that restarted knows neither (both 0) and refutes nothing.
    """
    if counter < confirmed:
        return (
            f"the driver's snapshot in the GCS is write {counter}, but the run's KV actor confirmed write "
            f"{confirmed}: an older snapshot of this run was written back"
        )
    if generation < kv_generation:
        return (
            f"the driver's snapshot in the GCS is of generation {generation}, but the run's KV actor holds "
            f"generation {kv_generation}: an older snapshot of this run was written back"
        )
    return None
