"""The executors' two ways of running: a persistent static session, and one elastic run per call.

`StaticSession` (a static `RayExecutor`): one `ElasticTrainer.fit()` with
`min_workers = max_workers = N` and `reset_limit=0` runs in a thread of the
executor from `start()` to `shutdown()`; its workers serve commands
(`worker_loop.ServeCommands`). A worker lost fails the session, as a dead
actor fails horovod.ray's static job: the calls after it raise naming why.

`run_elastic` (elastic mode): one `fit()` per call, its workers ephemeral,
as horovod.ray's elastic driver starts fresh workers for each `run()`; the
result is every finishing worker's value in rank order.

Both hand rank 0's `report()`s (`ray_logger.log`) to the call's callbacks as
`fit()` fetches them (`fit(on_report=...)`), in the thread running `fit()`; a
callback that raises fails its call once the workers are done, not `fit()`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import ray
from ray import cloudpickle

from ray_elastic import ElasticTrainer, ray_private
from ray_elastic.horovod.ray.mailbox import STOP, create_mailbox
from ray_elastic.horovod.ray.worker_loop import MARK, CallOnce, ServeCommands

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

_WAIT_S = 1.0  # one wait on the mailbox; the caller checks the session between waits
_MARK_TIMEOUT_S = 10.0  # rank 0's last reports of a call reaching the callbacks (fit() polls every 0.5 s)
_STOP_TIMEOUT_S = 60.0  # shutdown(): the workers leave and fit() cleans up


class Callbacks:
    """The current call's callbacks, fed rank 0's reports; notes the end-of-command markers."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._current: list[Callable[[Any], Any]] = []
        self._error: BaseException | None = None
        self._marked = -1

    def begin(self, callbacks: Iterable[Callable[[Any], Any]] | None) -> None:
        callbacks = list(callbacks or [])
        for c in callbacks:
            if not callable(c):
                raise ValueError(f"callbacks must be callables (a function or an object with __call__), got {c!r}")
        with self._changed:
            self._current, self._error = callbacks, None

    def end(self) -> BaseException | None:
        """Stop calling this call's callbacks; the first exception one raised, if any."""
        with self._changed:
            self._current, error, self._error = [], self._error, None
        return error

    def __call__(self, metrics: dict[str, Any]) -> None:
        if MARK in metrics:
            with self._changed:
                self._marked = max(self._marked, int(metrics[MARK]))
                self._changed.notify_all()
            return
        with self._changed:
            current = list(self._current)
        for callback in current:
            try:
                callback(metrics)
            except Exception as e:  # noqa: BLE001 - raised from the call, not from fit()'s loop
                logger.exception("a callback raised on %r", metrics)
                with self._changed:
                    self._error = self._error or e

    def wait_marked(self, seq: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._marked >= seq, timeout)


def values_in_rank_order(outcomes: dict[int, tuple[bool, bytes]]) -> list[Any]:
    """Each rank's value, by rank; the lowest failing rank's exception raised instead."""
    for rank in sorted(outcomes):
        ok, blob = outcomes[rank]
        if not ok:
            raise cloudpickle.loads(blob)
    return [cloudpickle.loads(outcomes[rank][1]) for rank in sorted(outcomes)]


class StaticSession:
    """N workers in one ring from `start()` to `shutdown()`, serving the executor's calls.

    Args:
        num_workers: the world size.
        env: environment variables set in each worker before it joins.
        executable: `(executable_cls, args, kwargs)` built once per worker.
        trainer_kwargs: the `ElasticTrainer` options (resources, discovery, timeouts, verbose).
    """

    def __init__(
        self,
        num_workers: int,
        env: dict[str, str],
        executable: tuple[Any, list[Any], dict[str, Any]],
        trainer_kwargs: dict[str, Any],
    ) -> None:
        self.num_workers = num_workers
        self.callbacks = Callbacks()
        self.mailbox = create_mailbox()
        self.failure: str | None = None
        self._actors: dict[int, str] = {}  # rank -> worker actor id, watched during calls
        self._ended = threading.Event()
        try:
            self._trainer = ElasticTrainer(
                ServeCommands(self.mailbox, env, executable),
                min_workers=num_workers,
                max_workers=num_workers,
                reset_limit=0,  # a static job's lost worker fails it, as in horovod.ray
                **trainer_kwargs,
            )
        except BaseException:
            ray.kill(self.mailbox)
            raise
        self._thread = threading.Thread(target=self._fit, name="ray-elastic-horovod-ray", daemon=True)
        self._thread.start()

    def _fit(self) -> None:
        try:
            self._trainer.fit(on_report=self.callbacks)
            self.failure = "the executor's workers were shut down (shutdown())"
        except BaseException as e:  # noqa: BLE001 - every ending is told to the calls
            self.failure = f"the executor's workers failed: {type(e).__name__}: {e}"
            logger.error("%s", self.failure)
        finally:
            self._ended.set()
            try:
                ray.get(self.mailbox.fail.remote(self.failure), timeout=10)
            except Exception:  # noqa: BLE001 - a mailbox already gone has no waiter left
                pass

    def wait_started(self, timeout: float) -> None:
        """Return once every worker joined and built its executable; raise naming why not.

        `TimeoutError` when not every worker started within `timeout` seconds
        (the cluster cannot place them), the worker's own exception when
        building the executable raised.
        """
        deadline = time.monotonic() + timeout
        while True:
            started = ray.get(self.mailbox.wait_started.remote(self.num_workers, _WAIT_S))
            for _, (ok, error) in sorted(started.items()):
                if not ok:
                    self.stop()
                    raise cloudpickle.loads(error)
            if len(started) >= self.num_workers:
                self._actors = ray.get(self.mailbox.actors.remote())
                return
            if self._ended.is_set() or time.monotonic() > deadline:
                why = self.failure or "still waiting"
                self.stop()
                raise TimeoutError(
                    f"{len(started)} of {self.num_workers} workers started within {timeout:g} s "
                    f"(placement_group_timeout_s + timeout_s); the cluster may lack the resources: {why}"
                )

    def call(self, fn: Callable[[Any], Any], ranks: frozenset[int] | None, callbacks: Any) -> list[Any]:
        """Run `fn(executable)` on every rank (or `ranks`); their values in rank order."""
        self._check_alive()
        self.callbacks.begin(callbacks)
        try:
            seq = ray.get(self.mailbox.send.remote("call", fn, ranks))
            wanted = sorted(ranks) if ranks is not None else list(range(self.num_workers))
            while True:
                try:
                    outcomes = ray.get(self.mailbox.outcomes.remote(seq, wanted, _WAIT_S))
                except ray.exceptions.RayTaskError as e:
                    raise RuntimeError(self.failure or str(e)) from None
                if set(wanted) <= set(outcomes):
                    break
                if self._ended.is_set():
                    raise RuntimeError(self.failure)
                self._check_workers_alive()
            if callbacks and not self.callbacks.wait_marked(seq, _MARK_TIMEOUT_S):
                logger.warning("rank 0's last reports of this call did not reach the callbacks within %g s", 10)
        finally:
            error = self.callbacks.end()
        values = values_in_rank_order(outcomes)
        if error is not None:
            raise error
        return values

    def submit(self, fn: Callable[[Any], Any]) -> list[Any]:
        """Run `fn(executable)` on every rank without waiting: one ObjectRef per rank, in rank order."""
        self._check_alive()
        seq = ray.get(self.mailbox.send.remote("call", fn, None))
        return [self.mailbox.value.remote(seq, rank) for rank in range(self.num_workers)]

    def stop(self) -> None:
        """End the workers' loop and wait (bounded) for `fit()` to clean up; the mailbox goes last."""
        if not self._ended.is_set():
            try:
                ray.get(self.mailbox.send.remote(STOP, None, None), timeout=10)
            except Exception:  # noqa: BLE001 - a mailbox gone means the workers are leaving anyway
                pass
            self._thread.join(_STOP_TIMEOUT_S)
            if self._thread.is_alive():
                logger.error("the executor's workers did not leave within %g s of shutdown()", _STOP_TIMEOUT_S)
        ray.kill(self.mailbox)

    def _check_alive(self) -> None:
        if self._ended.is_set():
            raise RuntimeError(self.failure)
        self._check_workers_alive()

    def _check_workers_alive(self) -> None:
        """A dead worker ends the session now (its call would wait for the run to time out otherwise)."""
        dead = sorted(rank for rank, actor_id in self._actors.items() if _actor_state(actor_id) == "DEAD")
        if dead:
            reason = (
                f"the executor's worker of rank {dead[0]} died; a static RayExecutor does not replace it "
                "(horovod.ray's neither): call shutdown() and start() again, or use elastic mode (min_workers=)"
            )
            logger.error("%s", reason)
            self.stop()
            self.failure = reason
            raise RuntimeError(reason)


def _actor_state(actor_id: str) -> str | None:
    """The actor's state in Ray's GCS ("ALIVE", "DEAD", ...); None when it cannot be read now."""
    try:
        return ray_private.actor_state(actor_id)
    except Exception:  # noqa: BLE001 - a GCS hiccup is no verdict
        return None


def run_elastic(
    fn: Callable[[Any], Any],
    env: dict[str, str],
    executable: tuple[Any, list[Any], dict[str, Any]],
    callbacks: Any,
    trainer_kwargs: dict[str, Any],
) -> list[Any]:
    """One elastic run of `fn(executable)`: the values of the workers that finished it, in rank order."""
    dispatch = Callbacks()
    dispatch.begin(callbacks)
    mailbox = create_mailbox()
    try:
        ElasticTrainer(CallOnce(mailbox, fn, env, executable), **trainer_kwargs).fit(on_report=dispatch)
        outcomes = ray.get(mailbox.all_outcomes.remote())
    finally:
        ray.kill(mailbox)
    error = dispatch.end()
    values = values_in_rank_order(outcomes[max(outcomes)]) if outcomes else []
    if error is not None:
        raise error
    return values
