"""What runs inside ray-elastic's worker actors for the executors: `train_fn`s built from horovod.ray calls.

- `ServeCommands` (a static `RayExecutor`): joins the ring, builds the
  executable once, then serves the executor's commands from its mailbox
  until `shutdown()`: each `run`/`execute`/`execute_single` is one command,
  and each rank posts its outcome under the command's number. The workers,
  their ring and the executable persist between calls, as horovod.ray's
  actors do.
- `CallOnce` (elastic mode): joins, builds the executable, runs the function
  once under the elastic machinery (`hvd.elastic.run` inside it resets and
  syncs as under `ray-elastic run`), and posts its result under the
  generation it finished in.

Both set the executor's environment variables before the worker joins the
ring, so a `GLOO_SOCKET_IFNAME` (from `nics`) or NCCL variable takes effect.
Rank 0 reports a marker after each command, so the executor knows every
report the command made has reached its callbacks.
"""

from __future__ import annotations

import functools
import os
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray import cloudpickle

import ray_elastic
from ray_elastic.horovod.ray.mailbox import STOP
from ray_elastic.horovod.ray.worker import BaseHorovodWorker
from ray_elastic.runtime import current

if TYPE_CHECKING:
    from collections.abc import Callable

MARK = "__ray_elastic_horovod_ray_command__"  # the key of rank 0's end-of-command report
_POLL_S = 30.0  # one wait for the next command; the loop waits again (pings are answered meanwhile)


def call_with(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Callable[[Any], Any]:
    """`run(fn, args, kwargs)`'s command: `fn(*args, **kwargs)`, the executable unused (as horovod.ray)."""

    def command(_executable: Any) -> Any:
        return fn(*args, **kwargs)

    return command


def pickled_outcome(call: Callable[[], Any]) -> tuple[bool, bytes]:
    """`(True, value pickled)`, or `(False, the exception pickled)` with its worker traceback as a note."""
    try:
        return True, cloudpickle.dumps(call())
    except BaseException as e:  # noqa: BLE001 - the caller gets every failure, as ray.get would raise it
        return False, pickled_error(e)


def pickled_error(error: BaseException) -> bytes:
    """The exception pickled, its worker traceback added as a note; as a RuntimeError if it does not pickle."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        error.add_note(f"raised in ray-elastic worker (rank {_rank_or_minus_one()}):\n{text}")
        return cloudpickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception that does not pickle goes back as text
        return cloudpickle.dumps(RuntimeError(text))


def _start(env: dict[str, str], executable: tuple[Any, list[Any], dict[str, Any]]) -> BaseHorovodWorker:
    """Set the environment, join the ring (as `hvd.init()`), build the executable."""
    os.environ.update(env)
    from ray_elastic.horovod.torch import init

    init()
    worker = BaseHorovodWorker(ray_elastic.rank(), ray_elastic.size())
    worker.start_executable(*executable)
    return worker


@dataclass(frozen=True)
class ServeCommands:
    """A static executor's worker: serve `mailbox` commands until `STOP` (picklable: the handle travels)."""

    mailbox: Any
    env: dict[str, str] = field(default_factory=dict)
    executable: tuple[Any, list[Any], dict[str, Any]] = (None, [], {})

    def __call__(self, config: dict[str, Any]) -> None:
        try:
            worker = _start(self.env, self.executable)
        except BaseException as e:  # noqa: BLE001 - said to the executor's start(), then the run fails with it
            ray.get(self.mailbox.started.remote(_rank_or_minus_one(), False, pickled_error(e)))
            raise
        rank = ray_elastic.rank()
        ray.get(self.mailbox.started.remote(rank, True, None, ray.get_runtime_context().get_actor_id()))
        seq = 0
        while True:
            command = ray.get(self.mailbox.next_command.remote(seq, _POLL_S))
            if command is None:
                continue
            kind, fn, ranks = command
            if kind == STOP:
                return
            if ranks is None or rank in ranks:
                ok, blob = pickled_outcome(functools.partial(worker.execute, fn))
                ray.get(self.mailbox.post.remote(seq, rank, ok, blob))
            if rank == 0:
                ray_elastic.report({MARK: seq})
            seq += 1


def _rank_or_minus_one() -> int:
    slot = current().slot  # the newest generation's, None before the first join
    return -1 if slot is None else slot.rank


@dataclass(frozen=True)
class CallOnce:
    """An elastic executor's worker: `fn(executable)` once, its result posted under its final generation."""

    mailbox: Any
    fn: Callable[[Any], Any]
    env: dict[str, str] = field(default_factory=dict)
    executable: tuple[Any, list[Any], dict[str, Any]] = (None, [], {})

    def __call__(self, config: dict[str, Any]) -> None:
        worker = _start(self.env, self.executable)
        value = worker.execute(self.fn)
        generation = current().joined()
        rank = generation.rank
        try:
            blob = cloudpickle.dumps(value)
        except Exception as e:
            raise TypeError(f"the function's result on rank {rank} cannot be pickled: {e}") from e
        ray.get(self.mailbox.post.remote(generation.number, rank, True, blob))
