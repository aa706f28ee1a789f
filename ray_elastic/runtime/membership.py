"""This worker's place in the ring: joining it, leaving it, and the host-change notices.

`Membership`

- joins: tells the driver it is ready (once, after importing its backend),
  then waits in the KV actor for a generation that includes it and builds
  that generation's ring through the backend factory;
- resets: tears the ring down and joins the next generation, or learns that
  it was removed (`WorkerRemovedError`);
- keeps the newest host-change notice the driver pushed into its memory, so
  `check_host_updates()` reads a field instead of polling anyone, and makes
  every rank agree on it (through the last gradient bucket when there is one);
- tells the driver once per generation that this rank finished its sync.

Every wait is bounded: the whole join by `rendezvous_timeout`, forming one
ring by `collective_timeout`.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from typing import TYPE_CHECKING

from ray_elastic.collective.factory import load_backend, make_group
from ray_elastic.exceptions import (
    GenerationSupersededError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    RendezvousTimeoutError,
    WorkerRemovedError,
)
from ray_elastic.runtime.boot_marks import BootMarks
from ray_elastic.wire import BackendNote, ResetRequested, TrainFnRaised, WorkerReady, WorkerSynced

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.collective.base import CollectiveGroup
    from ray_elastic.protocol import WorkerConfig
    from ray_elastic.rendezvous import KVClient
    from ray_elastic.wire import DriverLink

logger = logging.getLogger(__name__)


class Membership:
    """Generation, slot, ring and notices of this worker.

    Args:
        worker_id: this worker's id in the driver's assignments.
        kv: the client of the run's KV actor.
        driver: the driver actor's handle (`tell`: what this worker tells it,
            never awaited).
        settings: the backend and the timeouts.
        marks: the process's boot marks, stamped at the first join's points (None: a dict of its own).
    """

    def __init__(
        self, worker_id: str, kv: KVClient, driver: DriverLink, settings: WorkerConfig, marks: BootMarks | None = None
    ) -> None:
        self.worker_id = worker_id
        self.marks = BootMarks() if marks is None else marks
        self.kv = kv
        self.driver = driver
        self.settings = settings
        self.generation = 0
        self.slot: WorkerSlot | None = None
        self.group: CollectiveGroup | None = None
        self.notice = 0  # newest generation the driver announced to this worker
        self.synced_generation = 0  # the last generation this rank finished its sync in (0: never)
        # test seam: called with a point's name ("rendezvous") so fault-injection tests can fail a rank there
        self.fault_hook: Callable[[str], None] | None = None
        # (generation, any notice, or how to learn it) from the last gradient allreduce or DDP's forward
        self._agreed: tuple[int, bool | Callable[[], bool]] | None = None
        # an agreement reduced on a device (see agree_on_notice_deferred): (generation, how to start its copy to
        # host memory), then, once started, (generation, how to read it at the next check)
        self._to_copy: tuple[int, Callable[[], Callable[[], bool]]] | None = None
        self._to_read: tuple[int, Callable[[], bool]] | None = None
        self._at_commit = False  # the next check is a commit's (see committing)
        self._announced = False
        self._failure_told = 0  # the last generation whose failure this worker told the driver of
        self._abandoned: tuple[int, str] = (0, "")  # the newest generation the driver declared dead, and why
        self._ring_error_checks: list[Callable[[BaseException], bool]] = []  # see add_ring_error_check
        self._join_preparations: list[weakref.WeakMethod] = []  # see add_join_preparation

    # ---- joining and leaving -------------------------------------------------
    def ensure_joined(self) -> None:
        if self.group is None:
            self._join()

    def add_join_preparation(self, prepare: Callable[[], None]) -> None:
        """Run `prepare` (a bound method; held weakly) before this worker first tells the driver it is ready.

        `TorchState` uses it to allocate and fault in a newcomer's optimizer
        state and commit buffers from rank 0's published layout as part of
        its boot, which the survivors train through, instead of during the
        sync or its first step, which they wait for. Best effort: an error is
        logged.
        """
        self._join_preparations.append(weakref.WeakMethod(prepare))

    def run_join_preparations(self) -> None:
        """Run (once) what `add_join_preparation` registered, then collect Python's garbage in full and freeze it.

        The collection is due anyway: a process that just imported torch and
        built a model holds a few hundred thousand new objects, and Python's
        collector traverses them all the next time its oldest generation
        fills up. That came in a newcomer's sync, while every rank waited for
        it: 0.15 s of a 0.57 s sync at 100M parameters. Collected here, during
        the boot the survivors train through, the next full collection waits
        until a quarter as many objects again have piled up. Then
        `gc.freeze()` takes what is alive (the imports, the runtime, the
        state) out of every later collection: a later full collection (a
        `ray_elastic.train` re-entry's, before each call of the loop) reads
        only what was made since, milliseconds instead of 0.2-1.0 s on two
        busy cores. It runs before the first ring forms, so nothing of a ring
        or of `train_fn` is frozen (those must stay collectable: a ring's
        sockets and threads end with its objects). A process whose user
        switched the collector off is left as it is.
        """
        preparations, self._join_preparations = self._join_preparations, []
        for ref in preparations:
            prepare = ref()
            if prepare is None:
                continue
            try:
                prepare()
            except Exception as e:  # noqa: BLE001 - an optimization: the sync allocates what is missing
                logger.warning("worker %s: preparing for the sync failed (%s); going on", self.worker_id, e)
        if gc.isenabled():
            started = time.perf_counter()
            gc.collect()
            gc.freeze()
            logger.debug(
                "worker %s: collected garbage in %.3f s before joining, %d objects frozen",
                self.worker_id,
                time.perf_counter() - started,
                gc.get_freeze_count(),
            )

    def _join(self) -> None:
        if not self._announced:
            load_backend(self.settings.backend)
            self.marks.mark("backend_loaded")
            # before the announcement: once admitted, the survivors wait in the rendezvous for this worker
            self.run_join_preparations()
            self.driver.tell.remote(WorkerReady(self.worker_id))
            self._announced = True
            self.marks.mark("ready")
        deadline = time.monotonic() + self.settings.rendezvous_timeout
        after = self.generation
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and self.settings.spare and self.slot is None:
                # a hot spare waits to be admitted for as long as the run needs no one: the driver bounds its boot
                # and its hangs, and lets it go when the run ends (its orphan watch, when the driver is gone)
                deadline = time.monotonic() + self.settings.rendezvous_timeout
                continue
            if remaining <= 0:
                raise RendezvousTimeoutError(
                    f"worker {self.worker_id} found no generation to join within "
                    f"{self.settings.rendezvous_timeout:g} s (last generation {self.generation})"
                )
            generation, plan = self.kv.wait_generation(after, remaining, self.worker_id)
            slot = plan.get(self.worker_id)
            if slot is None:
                if self.slot is not None:
                    raise WorkerRemovedError(f"worker {self.worker_id} is not part of generation {generation}")
                after = generation  # a newcomer not yet admitted: wait for the next one
                continue
            self.marks.mark("admitted")
            if self.fault_hook is not None:
                self.fault_hook("rendezvous")
            try:
                self.group = make_group(
                    self.settings.backend,
                    self.kv,
                    generation,
                    slot.rank,
                    slot.size,
                    self.settings.collective_timeout,
                    local_rank=slot.local_rank,
                    requested=self.settings.backend_requested,
                    worker_id=self.worker_id,
                    note=lambda reason: self.driver.tell.remote(BackendNote(reason)),
                )
            except (HorovodInternalError, GenerationSupersededError, RendezvousTimeoutError) as e:
                # a peer died while the ring formed: the driver publishes a newer generation
                logger.info(
                    "worker %s: ring of generation %d did not form (%s); waiting for the next",
                    self.worker_id,
                    generation,
                    e,
                )
                self.driver.tell.remote(ResetRequested(self.worker_id, generation, str(e)))
                after = generation
                continue
            self.marks.mark("ring_formed")
            self.generation = generation
            self.slot = slot
            if generation <= self._abandoned[0]:  # declared dead while its ring formed
                self.group.abandon(self._abandoned[1])
            return

    def tell_failure(self, reason: str = "collective failed") -> None:
        """Tell the driver (once per generation, not awaited) that this generation's ring failed here, and leave it.

        The run loop calls it as soon as it catches the failure, before the
        state's restore, so the driver plans the next generation while the
        ranks restore (22-34 ms at 300M parameters + Adam) instead of after.
        """
        if self._failure_told != self.generation:
            self._failure_told = self.generation
            # the error itself: the driver quotes it if the same failure repeats in the next generation
            self.driver.tell.remote(ResetRequested(self.worker_id, self.generation, reason[:2000]))
        self._leave_ring()

    def tell_raised(self, error: str, traceback: str) -> None:
        """Tell the driver that `train_fn` raised here (it counts the attempt's failure), and leave the ring.

        This rank then waits for the next generation like any rank whose
        ring failed; the driver fails the run instead when `max_failures`
        is spent, quoting `traceback`.
        """
        if self._failure_told != self.generation:
            self._failure_told = self.generation
            self.driver.tell.remote(
                TrainFnRaised(self.worker_id, self.generation, error[:2000], traceback[-20000:])
            )
        self._leave_ring()

    def _leave_ring(self) -> None:
        if self.group is not None:
            # the state is restored next: no work of this ring may write into its tensors any more (invariant 7);
            # if the driver's abandon is cutting the ring on another thread, this waits for it to finish
            self.group.abandon("its ring failed on this rank")

    def reset(self, failed: bool) -> None:
        """Leave the current ring and join the next generation."""
        if failed:
            self.tell_failure()
        self.close_group()
        self._join()

    def close_group(self) -> None:
        self._agreed = None
        self._to_copy = self._to_read = None
        if self.group is not None:
            self.group.close()
            self.group = None

    def mark_synced(self, commits: int) -> None:
        """Tell the driver (once per generation) that this rank finished its sync, resuming from `commits`."""
        if self.synced_generation != self.generation:
            self.synced_generation = self.generation
            self.driver.tell.remote(WorkerSynced(self.worker_id, self.generation, time.time(), commits))

    def abandon(self, generation: int, reason: str) -> None:
        """Called by the driver (on a control thread): `generation`'s ring lost a member.

        The ring's collectives fail from now on, a blocked one at once (see
        `CollectiveGroup.abandon`), so this rank rolls back and joins the
        next generation without waiting out `collective_timeout`.
        """
        if generation > self._abandoned[0]:
            self._abandoned = (generation, reason)
        group = self.group
        if group is not None and self.generation == generation:
            group.abandon(reason)

    def add_ring_error_check(self, check: Callable[[BaseException], bool]) -> None:
        """Teach the run loop what a broken ring's error looks like when it is not a `HorovodInternalError`.

        DDP's reducer raises a failed gradient allreduce from `backward()` as
        a plain `RuntimeError`; `prepare_model` registers how to tell it from
        a bug in `train_fn`.
        """
        if check not in self._ring_error_checks:
            self._ring_error_checks.append(check)

    def ring_failure(self, error: BaseException) -> str | None:
        """Why `error` means the current ring is broken, or None.

        Broken: the driver abandoned the ring; or the ring's backend raised
        `error` (torch.distributed's errors from the default process group,
        which FSDP2 and other libraries call without any helper of ours:
        before the driver's abandon arrives, a survivor must not take a
        dead peer's reset connection for an error of `train_fn`); or a
        registered check knows it.
        """
        group = self.group
        if group is not None and group.abandoned is not None:
            return group.abandoned
        if group is not None and group.raised(error):
            return f"{type(error).__name__}: {error}"
        if any(check(error) for check in self._ring_error_checks):
            return f"{type(error).__name__}: {error}"
        return None

    # ---- host-change notices ---------------------------------------------------
    def notify(self, generation: int) -> None:
        """Called by the driver (on a control thread): a new generation awaits."""
        if generation > self.notice:
            self.notice = generation

    def agree_on_notice(self, pending: bool) -> None:
        """A collective all ranks ran (the gradient allreduce) told whether any rank holds a notice."""
        self._agreed = (self.generation, pending)
        self._to_copy = None

    def agree_on_notice_later(self, pending: Callable[[], bool]) -> None:
        """A collective all ranks started will tell whether any rank holds a notice; `pending()` waits for it."""
        self._agreed = (self.generation, pending)

    def agree_on_notice_deferred(self, start: Callable[[], Callable[[], bool]]) -> None:
        """An agreement reduced on a device (a GPU): read it without waiting for the device.

        At the next check, `start()` starts copying the reduced notice to host
        memory and returns how to read it; the check after that reads it (the
        copy is long done by then) and acts on it. A commit's check reads it
        at once. Every rank runs the same checks and commits, so every rank
        acts on the same agreement at the same step: one step later than
        an agreement read on the host, and never a device-to-host wait per
        step (which would stall the CPU's kernel launches behind the GPU).
        """
        self._agreed = None
        self._to_copy = (self.generation, start)

    def committing(self) -> None:
        """The next check is a commit's: read every agreement now (a commit waits for its copies anyway)."""
        self._at_commit = True

    def check_host_updates(self) -> None:
        """Raise `HostsUpdatedInterrupt` on every rank at once if the world changed.

        Uses the agreement carried by the last gradient allreduce when there is
        one not yet consumed (every rank has the same), else one tiny max-allreduce.
        An agreement reduced on a device is read one check later, or at once
        at a commit (`agree_on_notice_deferred`).
        """
        self.ensure_joined()
        at_commit, self._at_commit = self._at_commit, False
        agreed, self._agreed = self._agreed, None
        earlier, self._to_read = self._to_read, None
        to_copy, self._to_copy = self._to_copy, None
        gen = self.generation
        pending = earlier is not None and earlier[0] == gen and earlier[1]()
        if to_copy is not None and to_copy[0] == gen:
            read = to_copy[1]()
            if at_commit and not pending:
                pending = read()
            elif not pending:
                self._to_read = (gen, read)
        elif agreed is not None and agreed[0] == gen:
            pending = (agreed[1]() if callable(agreed[1]) else agreed[1]) or pending
        elif earlier is None or earlier[0] != gen:
            assert self.group is not None  # a check runs on a joined ring
            pending = self.group.max_int(self.notice) > gen
        if pending:
            raise HostsUpdatedInterrupt(skip_sync=False)
