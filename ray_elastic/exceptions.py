"""The exceptions users see, with the names Horovod Elastic users know.

`HorovodInternalError` and `HostsUpdatedInterrupt` drive the `run` loop in
every worker; `TrainingFailedError` is what `ElasticTrainer.fit()` raises on
the driver side; `RendezvousTimeoutError` is raised by every bounded wait and
names what it waited for; `CollectiveMismatchError` is a user's collective
whose arguments differ between ranks; `DataStarvedError` is a Ray Data
pipeline that could not run for want of CPUs.
"""

from __future__ import annotations

import traceback


class HorovodInternalError(RuntimeError):
    """A collective operation failed: a peer died or the ring broke.

    Inside `@elastic.run` this rolls the state back to the last commit and
    rebuilds the ring with the surviving workers.
    """


class HostsUpdatedInterrupt(RuntimeError):
    """The set of workers changed gracefully (hosts added or removed).

    Raised by `State.commit()` / `State.check_host_updates()` on every rank at
    the same step. The live state is kept (no rollback).
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class CollectiveMismatchError(ValueError):
    """Ranks called a collective with arguments that do not match.

    Which collective, the dtype, the shape (for allgather all but the first
    dimension), the reduce op or the root rank differed between ranks; the
    message names each rank's. A mistake in the training code, raised on every
    rank of the call before any data moved: not a broken ring, so `@elastic.run`
    does not retry it and the run fails with the user's traceback.
    """


class DeviceConflictError(ValueError):
    """The workers' devices cannot run the backend asked for: two ranks on one GPU under `backend="nccl"`.

    Raised on every rank before the ring forms, naming the workers, the GPU
    and the rule (NCCL allows one rank per GPU). Placement does not change
    between retries, so `@elastic.run` does not retry it: the run fails.
    """


class StateRegressionError(RuntimeError):
    """A sync would have made this rank adopt a commit older than the one it holds.

    Rank 0 of every generation holds the newest commit among its members;
    a rank 0 behind another rank's history would overwrite trained state
    with older state. Raised on that rank before anything is overwritten,
    and never retried: the run fails with this message rather than go on
    silently from older state.
    """


class RendezvousTimeoutError(TimeoutError):
    """A bounded wait ran out; the message names what was waited for."""


class DataStarvedError(RuntimeError):
    """A dataset produced no block for `data_starvation_timeout` seconds while the cluster had no free CPU.

    Ray Data's read and map tasks need CPUs; when the run's workers (or other
    jobs) hold every one, the pipeline never starts a task. Raised to the
    ranks waiting for the block, so the run fails with this message instead
    of waiting in silence; it names `data_cpus`, the option that keeps CPUs
    for the pipeline.
    """


class GenerationSupersededError(RuntimeError):
    """A newer generation was published while this one was still forming."""


class WorkerRemovedError(Exception):
    """This worker is not part of the new generation and should stop.

    Raised from the reset inside `@elastic.run`; the worker actor catches it
    and ends cleanly. It derives from `Exception`, not from the two elastic
    errors, so the run loop does not retry it.
    """


class CoordinatorDiedError(RuntimeError):
    """The run's driver or rendezvous (KV) actor died: no ring can form any more."""


class TrainingFailedError(RuntimeError):
    """`fit()` could not finish; the message carries the real reason.

    `return_value` is what rank 0's `train_fn` returned if it did return
    before the run failed (e.g. the other ranks could not finish), else None.
    """

    def __init__(self, message: str, return_value: object = None) -> None:
        super().__init__(message)
        self.return_value = return_value


class CheckpointError(RuntimeError):
    """A durable checkpoint could not be written or read, or holds what its opener refused (pickles)."""


class DiscoveryError(RuntimeError):
    """Discovery failed; the message carries the source's own error text."""


# mistakes that running again repeats: `@elastic.run` does not re-enter on them and `max_failures` never retries them
REPEATING: tuple[type[BaseException], ...] = (CollectiveMismatchError, DeviceConflictError, StateRegressionError)


def describe_exception(e: BaseException) -> str:
    """`Type: message`, even for an exception whose `__str__` raises (it must not pass for a death)."""
    try:
        text = str(e)
    except Exception as inner:  # noqa: BLE001 - the user's __str__ may raise anything
        text = f"<str() of the exception raised {type(inner).__name__}>"
    return f"{type(e).__name__}: {text}"


def format_traceback(e: BaseException) -> str:
    """The exception's traceback as Python prints it (its frames at least, if its `__str__` raises)."""
    try:
        return "".join(traceback.format_exception(type(e), e, e.__traceback__))
    except Exception:  # noqa: BLE001 - formatting calls the exception's __str__, which may raise
        return "".join(traceback.format_tb(e.__traceback__)) + describe_exception(e)
