"""One Tune trial as one elastic run: config merged, reports relayed, checkpoints handed to Tune.

Runs inside Tune's trial actor (`run_trial`). The trial's run is the
user's `ElasticTrainer` with three things changed: `train_fn`'s config with
the trial's `param_space` values merged over it, the workers placed on the
trial's reservation and what it grows into (`placement.py`), and, with
`checkpoint_dir`, a directory of the trial's own
(`<checkpoint_dir>/<experiment>/<trial id>`).

Every `report()` of rank 0 becomes `tune.report(...)`, in order, from the
thread running `fit()` (`fit(on_report=...)`); the newest durable checkpoint
committed before that report (and not handed over yet) goes with it, so
Tune persists it and `tune.get_checkpoint()` / the trial's
`Result.checkpoint` are ours, each holding no later state than the results
it came with (a checkpoint written after the run's last report is not handed
over: a report of its own would repeat a step in Tune's results). While
Tune copies it the checkpoint is pinned (no writer prunes it), and the
hand-over is bounded by `checkpoint_timeout`, the bound of the write of the
same bytes: past it the trial fails with a `CheckpointError` naming the
checkpoint, instead of hanging on a dead mount. A
restored trial (Tune's experiment resume) puts the checkpoint Tune hands
back into its directory first, and the run resumes from it. A worker lost
inside the trial is recovered by the run itself: Tune sees no failure and
one stream of results. When Tune stops the trial (a scheduler's decision),
`tune.report` raises in `fit()`'s thread, and `fit()` releases the run's
workers, driver and KV actor on its way out; the trial then gives back what
it grew into, and the trainable's `stop()` waits for all that
(`wait_for_release`) before Tune ends the process.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ray_elastic.checkpoint import CheckpointStore, bounded_call, normalize_url, order_key
from ray_elastic.tune.placement import NOMINAL, TrialSlots, remove_growth

logger = logging.getLogger(__name__)

_CHECKPOINT_LOOK_S = 1.0  # at most this often a report looks for a new durable checkpoint
_PIN_MARGIN_S = 60.0  # a pin outlives the hand-over's bound by this much (a slow unpin, a writer seeing it late)
_RELEASE_S = 40.0  # the longest a stopped trial's stop() waits for its run's clean-up (fit()'s is at most 35 s)
_released = threading.Event()  # set while no trial's run is being trained or cleaned up in this process
_released.set()


def wait_for_release() -> None:
    """Wait (up to `_RELEASE_S`) until this process's trial released its run: the trainable's `stop()` calls it.

    Tune kills a stopped trial's process as soon as `stop()` returns, while
    `fit()`'s clean-up runs in Tune's training thread: cut short, it would
    leave the run's workers or placement groups behind.
    """
    if not _released.wait(_RELEASE_S):
        logger.warning("the trial's run was not released within %g s; some of it may be left", _RELEASE_S)


def run_trial(trainer: Any, config: dict[str, Any]) -> None:
    """Train one trial with `trainer` (an `ElasticTrainer`), its config updated by `config`."""
    import ray
    from ray import tune

    context = tune.get_context()
    reservation = ray.util.get_current_placement_group()
    if reservation is None:
        raise RuntimeError("a ray-elastic trial must run under Tune with the resources as_trainable() asks for")
    settings = trainer.run_config
    # room for the spares (`spares=`) too, grown as room beyond max_workers' is
    slots = TrialSlots(reservation.id.hex(), settings.resources_per_worker, settings.max_workers + settings.spares)
    store = None
    # the workers ask Ray for nothing: their threads follow the CPUs the reservation holds for each
    changes: dict[str, Any] = {
        "resources_per_worker": dict(NOMINAL),
        "reserved_cpus": settings.resources_per_worker.get("CPU", 0.0),
    }
    if settings.checkpoint_dir is not None:
        url = normalize_url(
            f"{settings.checkpoint_dir}/{context.get_experiment_name()}/{context.get_trial_id()}"
        )
        store = CheckpointStore(url, keep=settings.checkpoint_keep)
        _adopt_tunes_checkpoint(store, tune.get_checkpoint())
        changes["checkpoint_dir"] = url
    # the trial's options are checked as the trainer's own were
    trial = trainer.variant(config=config, discovery=slots, **changes)
    relay = _Relay(store, handover_s=settings.checkpoint_io_timeout)
    _released.clear()
    try:
        trial.fit(on_report=relay)
    finally:  # fit() removed the run's groups; a growth group placed while its driver was killed is removed here
        try:
            remove_growth(reservation.id.hex())
        finally:
            _released.set()


def _adopt_tunes_checkpoint(store: CheckpointStore, checkpoint: Any) -> None:
    """Tune restored this trial: its checkpoint becomes the run's latest, which the run resumes from."""
    if checkpoint is None:
        return
    with checkpoint.as_directory() as local:
        path = store.adopt(local)
    logger.info("trial resumes from Tune's checkpoint %s (copied to %s)", checkpoint.path, path)


class _Relay:
    """`fit(on_report=...)`'s callable: each of rank 0's reports to Tune, with the checkpoint that matches it.

    Args:
        store: the trial's checkpoint directory, or None (no checkpoints).
        handover_s: the bound of one report that carries a checkpoint (Tune
            copies the checkpoint to its storage inside `tune.report`).
    """

    takes_stamp = True  # fit() passes each report's time with it: checkpoints committed before it may go along

    def __init__(self, store: CheckpointStore | None, handover_s: float = 300.0) -> None:
        self.store = store
        self.handover_s = handover_s
        self._reported: tuple[int, int, int] | None = None  # the order of the newest checkpoint handed to Tune
        self._looked: float | None = None  # never listed: the first report lists, however soon after boot
        self._listing: list[tuple[str, dict[str, Any]]] = []  # the complete checkpoints when last listed

    def __call__(self, metrics: dict[str, Any], stamp: float | None = None) -> None:
        from ray import tune

        path = None
        if self.store is not None:
            # Listed at most once a second, but every report is matched against the listing: reports come in
            # bursts (fit() fetches them twice a second), and a burst's first report is older than a checkpoint
            # its later ones may carry.
            if self._looked is None or time.monotonic() - self._looked >= _CHECKPOINT_LOOK_S:
                store = self.store
                listing = f"listing the checkpoints in {store.url} for Tune (bounded by checkpoint_timeout)"
                self._listing = bounded_call(self.handover_s, listing, lambda: list(store.complete()))
                self._looked = time.monotonic()
            path = self._new_checkpoint(stamp)
        if path is None:
            tune.report(dict(metrics))
            return
        assert self.store is not None
        store = self.store

        def hand_over() -> None:
            with store.pinned(path, self.handover_s + _PIN_MARGIN_S):
                if not store.is_complete(path):  # pruned between the listing and the pin: the next report's
                    tune.report(dict(metrics))
                    return
                tune.report(dict(metrics), checkpoint=self._tune_checkpoint(path))

        what = f"handing the checkpoint {store.url_of(path)} to Tune (tune.report, bounded by checkpoint_timeout)"
        bounded_call(self.handover_s, what, hand_over)

    def _new_checkpoint(self, stamp: float | None) -> str | None:
        """The newest listed checkpoint committed at or before `stamp` and newer than the last handed over, or None."""
        chosen = None
        for path, meta in self._listing:
            committed = meta.get("committed_at", meta.get("written_at", 0.0))
            if stamp is not None and committed > stamp:
                continue  # it holds state newer than this report: it goes with a later one
            if self._reported is None or order_key(meta) > self._reported:
                chosen = (path, order_key(meta))
        if chosen is None:
            return None
        self._reported = chosen[1]
        return chosen[0]

    def _tune_checkpoint(self, path: str) -> Any:
        from ray import tune

        assert self.store is not None
        if self.store.is_local():
            return tune.Checkpoint.from_directory(path)
        import pyarrow.fs

        return tune.Checkpoint(path, filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(self.store.fs)))
