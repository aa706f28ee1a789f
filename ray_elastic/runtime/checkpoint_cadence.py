"""Which commits become durable checkpoints, and resuming from one.

Rank 0 hands every `checkpoint_every`-th commit, as plain entries (state
dicts, values: `checkpoint/entries.py`), to a background `CheckpointWriter`;
a sharded model's rows are written first by every rank, in DCP's format
under `checkpoint_dir/sharded/commit-N` (synchronously: `dcp.save` is a
collective), and rank 0's entries name that directory
(the copy and the hand-over are set aside from its pace: `runtime/pace.py`)
(writes are retried and bounded by `checkpoint_timeout`; the store keeps the
newest `checkpoint_keep`),
and a rank 0 that never synced loads the last durable checkpoint before its
first sync (bounded by `checkpoint_timeout` too: the other ranks wait for it
in the sync; storage that does not answer is a `CheckpointError` naming it).
Without `checkpoint_dir` every method does nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import TYPE_CHECKING, Any

from ray_elastic.checkpoint import CheckpointStore, CheckpointWriter, bounded_call
from ray_elastic.checkpoint.entries import load_entries, state_entries
from ray_elastic.runtime.pace import PACE
from ray_elastic.wire import WorkerResumed

if TYPE_CHECKING:

    from ray_elastic.assignment import WorkerSlot
    from ray_elastic.protocol import WorkerConfig
    from ray_elastic.rendezvous import KVClient
    from ray_elastic.wire import DriverLink

logger = logging.getLogger(__name__)


class CheckpointCadence:
    """Counts commits; rank 0 checkpoints every `settings.checkpoint_every`-th one.

    Args:
        worker_id: this worker's id, for the driver and the log.
        driver: the driver actor's handle (rank 0 tells it `WorkerResumed`).
        settings: `checkpoint_dir`, `checkpoint_every`, `checkpoint_keep` and `checkpoint_timeout`
            (the bound of one checkpoint write and of the final flush).
    """

    def __init__(
        self, worker_id: str, driver: DriverLink, settings: WorkerConfig, kv: KVClient | None = None
    ) -> None:
        self.worker_id = worker_id
        self.driver = driver
        self.settings = settings
        self._kv = kv
        self._writer: CheckpointWriter | None = None
        if settings.checkpoint_dir is not None:
            self._writer = CheckpointWriter(
                CheckpointStore(settings.checkpoint_dir, keep=settings.checkpoint_keep), fence=self._stale
            )
        self._resume_checked = False

    def _stale(self, meta: dict[str, Any]) -> str | None:
        """Why a checkpoint of `meta`'s generation must not be written (this worker is no longer rank 0), or None.

        A rank 0 cut off from the run (a partition) is replaced while it is
        away; when the network heals it must not write its stale state over
        the new rank 0's checkpoints. A newer generation alone proves
        nothing: one that admitted a newcomer keeps rank 0 where it was, so
        the KV actor's newest plan is asked whether this worker is still its
        rank 0. A worker that cannot reach the KV actor writes nothing.
        """
        if self._kv is None:
            return None
        generation = meta["generation"]
        try:
            if self._kv.current_generation(timeout=10.0) <= generation:
                return None
            # returns at once (a newer generation exists) with that generation's slot of this worker, if any
            newest, mine = self._kv.wait_generation(generation, 10.0, self.worker_id)
        except Exception as e:  # noqa: BLE001 - unreachable or gone: this worker cannot vouch for its generation
            return f"the run's KV actor could not confirm generation {generation} is current ({e})"
        slot = mine.get(self.worker_id)
        if slot is None:
            return f"{self.worker_id} is not a member of generation {newest}, which superseded {generation}"
        if slot.rank != 0:
            return f"{self.worker_id} is rank {slot.rank} of generation {newest}, not rank 0: checkpoints are rank 0's"
        return None

    def after_commit(self, state: Any, slot: WorkerSlot | None, generation: int, commits: int) -> None:
        """Rank 0 hands every `checkpoint_every`-th commit (the run's `commits`-th) to the checkpoint writer.

        The copy and any wait for the previous write are the framework's work on rank 0 alone: set aside from
        its pace, so the straggler watch never takes them for slowness.
        """
        if self._writer is None or slot is None or commits % self.settings.checkpoint_every:
            return
        sharded = getattr(state, "write_shards", None)
        if sharded is not None:
            with PACE.aside():  # every rank writes its own rows of a sharded model, at the same commit
                if sharded(self._sharded_directory(commits)) and slot.rank == 0:
                    self._prune_sharded(keep=self.settings.checkpoint_keep + 1)
        if slot.rank != 0:
            return
        meta = {
            "commit": commits,
            "generation": generation,
            "world_size": slot.size,
            "run": self.settings.run_id,  # orders it after the checkpoints of the run it resumed from
            "committed_at": time.time(),  # matches it to the reports made after it (Tune's hand-over)
        }
        with PACE.aside():
            self._writer.submit(state_entries(state), meta, timeout=self.settings.checkpoint_timeout)

    def _sharded_directory(self, commits: int) -> str:
        return os.path.join(str(self.settings.checkpoint_dir), "sharded", f"commit-{commits:08d}")

    def _prune_sharded(self, keep: int) -> None:
        """Remove all but the `keep` newest sharded directories (rank 0; the manifests name the newest)."""
        root = os.path.join(str(self.settings.checkpoint_dir), "sharded")
        for name in sorted(os.listdir(root))[:-keep]:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    def maybe_resume(self, state: Any, slot: WorkerSlot | None, ever_synced: bool) -> dict[str, Any] | None:
        """Before a sync: a rank 0 that never synced loads the durable checkpoint, if there is one; returns its meta.

        Rank 0 is the oldest worker, so a rank 0 that never synced means no
        worker holds trained state: a new `fit()`, or every worker was lost.
        """
        if self._writer is None or self._resume_checked or ever_synced or slot is None:
            return None
        if slot.rank != 0:
            return None
        self._resume_checked = True
        return self._load_newest(state, None)

    def load_newest(self, state: Any, slot: WorkerSlot | None, reason: str) -> dict[str, Any] | None:
        """Rank 0, within a run: load the newest durable checkpoint into `state` because of `reason`; its meta.

        For a sharded model whose owner and replica of some rows were both
        lost: the run goes back to the newest durable commit instead of failing.
        """
        if self._writer is None or slot is None or slot.rank != 0:
            return None
        self._writer.flush(self.settings.checkpoint_timeout)  # the newest checkpoint handed over, if it can be
        return self._load_newest(state, reason)

    def _load_newest(self, state: Any, reason: str | None) -> dict[str, Any] | None:
        assert self._writer is not None
        store = self._writer.store
        found = bounded_call(
            self.settings.checkpoint_timeout,
            f"reading the durable checkpoint in {self.settings.checkpoint_dir} (checkpoint_timeout)",
            # the run's own checkpoint_dir, which the user named, is trusted with pickles; no other place is read
            lambda: store.read(allow_pickle=True),
        )
        if found is None:
            return None
        entries, meta = found
        load_entries(state, entries)
        logger.info(
            "worker %s resumed from the checkpoint in %s: %s", self.worker_id, self.settings.checkpoint_dir, meta
        )
        self.driver.tell.remote(WorkerResumed(self.worker_id, meta if reason is None else {**meta, "reason": reason}))
        return meta

    def flush(self) -> str | None:
        """Wait for the last checkpoint write (rank 0, before it returns); None if it is durable, else why not."""
        if self._writer is None:
            return None
        return self._writer.flush(self.settings.checkpoint_timeout)
