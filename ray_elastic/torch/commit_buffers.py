"""A commit's tensors: copied once into buffers that are reused, traded back on a restore, refilled behind it.

`TensorBuffers` mirrors a list of tensors. A tensor that changes only
through an optimizer step (`guarded`) is restored by trading its storage
with its buffer (`swappable` says when that leaves nobody's view behind),
and its buffer is refilled on a background thread, behind the copy gate
(`copy_gate.py`); the optimizer's next step waits for that copy.
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
    """Whether `t` alone owns its storage, so trading it for `b`'s leaves nobody else's view behind."""
    return (
        t.shape == b.shape
        and t.dtype == b.dtype
        and t.device == b.device
        and t._base is None
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )



class TensorBuffers:
    """Buffers that mirror a list of tensors: allocated once and reused, refilled in the background after a restore.

    `guarded[i]` says that tensor i changes only through an optimizer step,
    which calls `touched()` first: such a tensor is restored by trading
    storages with its buffer and re-copied on a background thread.
    """

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.untouched = False  # the guarded live tensors still equal the buffers' commit (no step since)
        # by index, of the last trade: (the live tensor, weakly; its data_ptr; the buffer's data_ptr). While
        # all three still hold, the pair is still swappable, and a restore of thousands of tensors need not
        # check swappable's seven properties again. Nothing held: a stale entry keeps no memory.
        self._traded: dict[int, tuple[weakref.ref, int, int]] = {}
        self._copier: threading.Thread | None = None
        self._hurry = threading.Event()  # set: the running copy is waited for, it must not hold back
        self._copy_error: BaseException | None = None

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
        self.untouched = True

    def save_later(self, tensors: Sequence[torch.Tensor], guarded: Sequence[bool]) -> None:
        """Like `save`, but the guarded tensors are copied on a background thread."""
        self.wait()
        self._fit(tensors)
        later = []
        with torch.no_grad():
            for b, t, g in zip(self.buffers, tensors, guarded, strict=True):
                if g:
                    later.append((b, t.detach()))  # the storage `t` holds now, whatever `t` holds later
                else:
                    b.copy_(t)
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
                    t.copy_(b)
        self.untouched = True
        self._copy_in_background(later)

    def touched(self) -> None:
        self.wait()
        self.untouched = False

    def wait(self) -> None:
        """Block until a background copy finished."""
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
        # the buffers are overwritten in place by the next save: a checkpoint needs its own copy
        self.wait()
        return [b.clone() for b in self.buffers]
