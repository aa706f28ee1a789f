"""The torch.distributed Gloo backend, the default on CPU.

A `TorchDistGroup` running Gloo: values stay where they are (numpy arrays
and CPU tensors are reduced in place, without a copy). A tensor on any other
device (a GPU) goes through host memory, and reducing host copies is what
Gloo does on CPU, so results are bitwise those of a CPU run:

- an allreduce or a broadcast of a CUDA tensor is handed to torch's Gloo as
  it is: torch copies it into pinned host memory on a stream of its own,
  ordered after the caller's current stream, and back once the ring is done
  (`Work.wait()` makes the caller's stream wait for that copy). Nothing
  waits for the GPU on the host: the gradient buckets' allreduces start
  from the backward hooks while the GPU is still computing the earlier
  layers' gradients. This is the path torch's DDP takes on a Gloo ring;
- a send or a receive (a newcomer's state), and any other device's tensor,
  go through a host buffer of ours (pinned where the device allows, so the
  copies run at full speed): Gloo's send and receive take host memory only
  (a CUDA pointer fails with "writev ... Bad address").

Gloo reduces with a
bitwise or, so `bitwise_or_` is one allreduce instead of a gather.
`shared_ring()` is the generation's shared-memory allreduce when all its
ranks run on one machine (`ray_elastic.collective.shm`), built on first use.
The ring's TCP connections are noted as it forms, so an abandoned ring can be
cut (`ring_sockets`): none of its works completes after the abandon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ray_elastic.collective.ring_sockets import RingSockets
from ray_elastic.collective.shm import SharedRing
from ray_elastic.collective.torch_dist import TorchDistGroup, as_tensor

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np

_UNBUILT = object()


def on_host(t: torch.Tensor) -> bool:
    """Whether Gloo can use `t`'s memory as it is (a CPU tensor)."""
    return t.device.type == "cpu"


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor shaped as `like`: pinned when `like` is on a GPU (torch caches pinned blocks)."""
    if like.is_cuda:
        try:
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
        except RuntimeError:  # pinned memory exhausted or locked down: pageable still works, slower
            pass
    return torch.empty(like.shape, dtype=like.dtype)


def torch_stages(t: torch.Tensor) -> bool:
    """Whether torch's Gloo allreduce and broadcast take `t` as it is, staging it without a host wait (CUDA)."""
    return t.is_cuda


def stage_on_host(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """`t` as a host tensor Gloo can use, and how to copy a result back into `t` (None: `t` is on the host)."""
    if on_host(t):
        return t, None
    host = host_buffer(t)
    host.copy_(t)  # blocking: Gloo reads the buffer from its own thread as soon as the work starts
    return host, lambda: t.copy_(host)


class TorchGlooGroup(TorchDistGroup):
    """A torch.distributed Gloo process group for one generation."""

    name = "gloo"
    backend = "gloo"
    abortable = True
    _shared: SharedRing | None | object = _UNBUILT

    def _stage(self, value: object) -> tuple[torch.Tensor, Callable[[], None] | None]:
        return stage_on_host(as_tensor(value))

    def _stage_reduced(self, value: object) -> tuple[torch.Tensor, Callable[[], None] | None]:
        t = as_tensor(value)
        if torch_stages(t):
            return t, None
        return stage_on_host(t)

    def _create(self, create: Callable[[], None]) -> None:
        """Create the process group and note its connections, which `abandon()` cuts (see `ring_sockets`)."""
        _, self._sockets = RingSockets.opened_by(create)

    def shared_ring(self) -> SharedRing | None:
        """This generation's shared-memory allreduce, or None where the ranks do not share a machine.

        Built on the first call, which every rank makes at the same point (three small collectives).
        """
        if self._shared is _UNBUILT:
            self._shared = SharedRing.build(self, self._timeout_s)
        return self._shared  # type: ignore[return-value]

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if isinstance(shared, SharedRing):
            shared.close()
        super().close()

    def bitwise_or_(self, value: np.ndarray) -> np.ndarray:
        if self.size == 1:
            return value
        tensor = torch.from_numpy(value)
        self._run("bitwise or", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.BOR, async_op=True))
        return value
