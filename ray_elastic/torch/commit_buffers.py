"""A commit's tensors: copied once into buffers that are reused, traded back on a restore, refilled behind it.

`TensorBuffers` mirrors a list of tensors, each buffer on its tensor's
device. On the host, a tensor that changes only through an optimizer step
(`guarded`) is restored by trading its storage with its buffer
(`swappable` says when that leaves nobody's view behind), and its buffer
is refilled on a background thread, behind the copy gate (`copy_gate.py`);
the optimizer's next step waits for that copy. That trade is the measured
fast path of a rollback on the CPU, and it stays there.

On a device (a GPU), every copy is queued in the calling thread on its
current stream, so it is ordered after the loop's own work on that stream,
and `wait()` makes the then-current stream wait for it (an event, no host
wait): a loop on a stream of its own never steps while a commit copy is
still queued. A rollback copies the commit into the live tensors: their
addresses never change, so CUDA graphs that captured them (`torch.compile`'s
"reduce-overhead", a captured optimizer step) stay valid; the buffers keep
the commit, so nothing is refilled. A durable checkpoint takes host copies
(`host_copy`), never a second copy on the device.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch

from ray_elastic.torch import copy_gate
from ray_elastic.torch.broadcast import wait_while_transferring

if TYPE_CHECKING:
    from collections.abc import Sequence


def swappable(t: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `t` is a host tensor that alone owns its storage, so trading it for `b`'s leaves nobody's view behind.

    Never on a device: a device tensor keeps its address (see the module docstring).
    """
    return (
        t.device.type == "cpu"
        and t.shape == b.shape
        and t.dtype == b.dtype
        and t.device == b.device
        and t._base is None
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` as a new CPU tensor: a clone on the host; from a device, copied straight into host memory.

    The device-to-host copy takes no device memory: a checkpoint of a GPU
    state costs host memory only.
    """
    if t.device.type == "cpu":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype)
    copy_to_host(host, t)
    return host


def copy_to_host(host: torch.Tensor, t: torch.Tensor) -> None:
    """The one device-to-host copy of `host_copy` (a test on the `meta` device, which holds no bytes, replaces it)."""
    host.copy_(t)


class TensorBuffers:
    """Buffers that mirror a list of tensors: allocated once and reused, refilled in the background after a restore.

    `guarded[i]` says that tensor i changes only through an optimizer step,
    which calls `touched()` first: such a host tensor is restored by trading
    storages with its buffer and re-copied on a background thread; a device
    tensor is copied into, in place, on the current stream.
    """

    def __init__(self) -> None:
        self.buffers = []
        self._queued: list[tuple[torch.device, torch.cuda.Event]] = []  # device copies not yet waited for
        self.untouched = False  # the guarded live tensors still equal the buffers' commit (no step since)
        # by index, of the last trade: (the live tensor, weakly; its data_ptr; the buffer's data_ptr). While
        # all three still hold, the pair is still swappable, and a restore of thousands of tensors need not
        # check swappable's seven properties again. Nothing held: a stale entry keeps no memory.
        self._traded: dict[int, tuple[weakref.ref, int, int]] = {}
        self._copier: threading.Thread | None = None
        self._hurry = threading.Event()  # set: the running copy is waited for, it must not hold back
        self._copy_error: BaseException | None = None

    @property
    def buffers(self) -> list[torch.Tensor]:
        return self._buffers

    @buffers.setter
    def buffers(self, buffers: list[torch.Tensor]) -> None:
        self._buffers = buffers
        self._cuda = sorted({b.device for b in buffers if b.device.type == "cuda"}, key=str)  # whose copies queue

    def _queue_mark(self) -> None:
        """After copies were queued on the current streams: an event on each, which `wait()` waits on."""
        self._queued = [(d, torch.cuda.current_stream(d).record_event()) for d in self._cuda]

    def _fit(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(self.buffers) != len(tensors) or any(
            b.shape != t.shape or b.dtype != t.dtype or b.device != t.device
            for b, t in zip(self.buffers, tensors, strict=True)
        ):
            self.buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
            self._traded.clear()

    def save(self, tensors: Sequence[torch.Tensor]) -> None:
        self.wait()
        self._fit(tensors)
        with torch.no_grad():
            for b, t in zip(self.buffers, tensors, strict=True):
                b.copy_(t)
        self._queue_mark()
        self.untouched = True

    def save_later(self, tensors: Sequence[torch.Tensor], guarded: Sequence[bool]) -> None:
        """Like `save`, but the guarded tensors are copied on a background thread."""
        self.wait()
        self._fit(tensors)
        later = []
        with torch.no_grad():
            for b, t, g in zip(self.buffers, tensors, guarded, strict=True):
                if g and t.device.type == "cpu":
                    later.append((b, t.detach()))  # the storage `t` holds now, whatever `t` holds later
                else:
                    b.copy_(t)  # on a device: queued on the current stream, no host time
        self._queue_mark()
        self.untouched = True
        self._copy_in_background(later)

    def restore(self, tensors: Sequence[torch.Tensor], guarded: Sequence[bool]) -> None:
        self.wait()
        later = []
        traded = self._traded
        with torch.no_grad():
            for i, (t, g) in enumerate(zip(tensors, guarded, strict=True)):
                b = self.buffers[i]
                if g and self.untouched:
                    continue  # no step since the commit: the live tensor is the commit
                last = traded.get(i)
                if g and (
                    (last is not None and last[0]() is t and last[1] == t.data_ptr() and last[2] == b.data_ptr())  # type: ignore[union-attr]  # `is t` narrows t to the weakref's Optional
                    or swappable(t, b)
                ):
                    old = t.data
                    t.data = b
                    self.buffers[i] = old
                    traded[i] = (weakref.ref(t), b.data_ptr(), old.data_ptr())
                    # re-copied from the commit's storage itself (b), not from `t`: whatever the user points
                    # `t` at before the copy runs, the buffer gets the commit
                    later.append((old, b))
                else:
                    t.copy_(b)  # in place: a device tensor keeps its address (CUDA graphs)
        self._queue_mark()
        self.untouched = True
        self._copy_in_background(later)

    def touched(self) -> None:
        self.wait()
        self.untouched = False

    def wait(self) -> None:
        """Block until a background copy finished; the current streams wait for the device copies queued."""
        queued, self._queued = self._queued, []
        for device, event in queued:
            torch.cuda.current_stream(device).wait_event(event)
        copier, self._copier = self._copier, None
        if copier is not None:
            with copy_gate.gate:  # a copy held back for a reset is needed now
                self._hurry.set()
                copy_gate.gate.notify_all()
            copier.join()
        error, self._copy_error = self._copy_error, None
        if error is not None:
            raise RuntimeError(f"copying the commit in the background failed: {error}") from error

    def _copy_in_background(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return

        hurry = self._hurry = threading.Event()

        def copy_all() -> None:
            copy_gate.wait_for_release(hurry)
            try:
                with torch.no_grad():
                    for b, t in pairs:
                        wait_while_transferring()  # a sync's transfer first (a newcomer's page faults)
                        b.copy_(t)
            except BaseException as e:  # noqa: BLE001 - surfaced by wait(), in the training thread
                self._copy_error = e

        self._copier = threading.Thread(target=copy_all, name="ray_elastic-commit-copy", daemon=True)
        self._copier.start()

    def copies(self) -> list[torch.Tensor]:
        """Host copies of the commit, for a durable checkpoint (the buffers are overwritten by the next save)."""
        self.wait()
        return [host_copy(b) for b in self.buffers]
