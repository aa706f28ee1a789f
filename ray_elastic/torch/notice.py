"""Reading the ranks' agreed host-change notice off a device without stalling it.

The agreement on a host change rides in a gradient allreduce (the last
bucket's extra element) or in a one-number allreduce of its own (DDP on
NCCL). On the host, reading it costs nothing. On a GPU, `.item()` waits
until the device has run everything queued before it: the CPU stops
queueing the next step's kernels and the GPU runs dry once per step
(measured on an H200 at 134M parameters: 7.9 ms per step against plain
DDP's 5.96 ms). So a device's notice is copied, without waiting, into
pinned host memory behind the allreduce, and read at the next check, when
the copy is long done; `Membership.agree_on_notice_deferred` keeps every
rank acting at the same step.

`reads_later` says which tensors take that path: those not in host memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ray_elastic.collective.torch_gloo import host_buffer

if TYPE_CHECKING:
    from collections.abc import Callable


def reads_later(t: torch.Tensor) -> bool:
    """Whether reading `t` on the host would wait for a device (it does not live in host memory)."""
    return t.device.type != "cpu"


def host_value(t: torch.Tensor) -> float:
    """The first element of a host tensor, read without a tensor call (`.item()`), whatever its dtype."""
    return float(t.reshape(-1)[:1].to(torch.float64).numpy()[0])


class NoticeCopy:
    """A reduced notice (`reduced[0]`, a count or a max) on its way to host memory; `any()` reads it.

    Args:
        reduced: the device tensor holding the notice once the collective is done.
        before_read: called first by `any()` (the collective's own wait, which
            raises the ring's error; done by then, so it returns at once).
    """

    __slots__ = ("_host", "_event", "_before_read")

    def __init__(self, reduced: torch.Tensor, before_read: Callable[[], None] | None = None) -> None:
        first = reduced.detach().reshape(-1)[:1].to(torch.float32)
        self._host = host_buffer(first)
        # without waiting only where an event can tell when the copy landed (CUDA); elsewhere a plain copy
        self._host.copy_(first, non_blocking=first.is_cuda)
        self._event = None
        if first.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._before_read = before_read

    def any(self) -> bool:
        """Whether any rank held a notice: waits only for a copy queued a step ago (at a commit: this step's)."""
        if self._before_read is not None:
            self._before_read()
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        return host_value(self._host) > 0
