"""`BaseHorovodWorker`: what holds the user's executable inside each worker, with horovod.ray's methods.

In horovod.ray it is the Ray actor class itself; here ray-elastic's worker
actor runs the training function, and this object lives inside it: it
builds `executable_cls(*args, **kwargs)` once (`start_executable`) and calls
`fn(executable)` for `execute`. Its helper methods (`node_id`, `hostname`,
`get_gpu_ids`, `update_env_vars`, `env_vars`, `set_queue`) work as
horovod.ray's do, so a class written as a mixin of it keeps working.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import ray

from ray_elastic.horovod.ray import ray_logger

if TYPE_CHECKING:
    from collections.abc import Callable


class BaseHorovodWorker:
    """One worker's executable and environment (horovod.ray's name and methods).

    Args:
        world_rank: this worker's rank; sets `HOROVOD_RANK` (the ring's own
            rank, from `hvd.rank()`, is the one that counts after a reset).
        world_size: the world size; sets `HOROVOD_SIZE`.
    """

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        os.environ["HOROVOD_HOSTNAME"] = self.node_id()
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    def node_id(self) -> str:
        """The Ray node ID of this process's node ('' outside Ray)."""
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""

    def hostname(self) -> str:
        return socket.gethostname()

    def get_gpu_ids(self) -> list[int]:
        """The CUDA devices Ray gave this worker."""
        return ray.get_gpu_ids()

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        """Set environment variables in this process (values made strings)."""
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        return dict(os.environ)

    def start_executable(
        self,
        executable_cls: type | None = None,
        executable_args: list[Any] | None = None,
        executable_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Build `executable_cls(*executable_args, **executable_kwargs)`; without a class, `executable` is None."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """`func(executable)`."""
        return func(self.executable)

    def set_queue(self, queue: Any) -> None:
        """Send this process's `ray_logger.log` dicts to `queue.put()` (horovod.ray's logging hook)."""
        ray_logger.configure(queue)
