"""Faulting fresh memory in before it is written: one system call per range instead of a page fault per page.

A newcomer's state is mostly fresh memory (an optimizer's moments are
allocated as they arrive), and on a VM the first touch of a page costs about
as much as receiving its bytes. `madvise(MADV_POPULATE_WRITE)` (Linux 5.14
and later) makes a range present and writable inside the kernel, without the
exception per page or the write pass of a `zero_()`. Elsewhere (another OS,
an older kernel) `populate_range` says False and the caller touches the
memory itself.

Asking it of memory already present is not free: the kernel still looks each
page up for writing (about 0.1 s of CPU per 1.2 GB here, a third of a
newcomer's whole receive). `resident_range` asks `mincore` first, a read of
the page tables that costs a few milliseconds for the same range.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys

_MADV_POPULATE_WRITE = 23  # include/uapi/asm-generic/mman-common.h
_PAGE = mmap.PAGESIZE
_probed = False

_madvise = None
_mincore = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _madvise.restype = ctypes.c_int
        _mincore = _libc.mincore
        _mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _mincore.restype = ctypes.c_int
    except (OSError, AttributeError):
        _madvise = _mincore = None


def _whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """The page-aligned `[start, stop)` of the pages entirely inside `[address, address + nbytes)`."""
    return -(-address // _PAGE) * _PAGE, (address + nbytes) // _PAGE * _PAGE


def resident_range(address: int, nbytes: int) -> bool:
    """Whether every whole page of `[address, address + nbytes)` is present in memory (False if unknown)."""
    if _mincore is None:
        return False
    start, stop = _whole_pages(address, nbytes)
    if stop <= start:
        return True
    pages = (stop - start) // _PAGE
    vector = (ctypes.c_ubyte * pages)()
    if _mincore(start, stop - start, vector) != 0:
        return False
    return _NOT_RESIDENT not in bytes(vector).translate(_LOW_BIT)


_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore's other bits are reserved
_NOT_RESIDENT = b"\x00"


def populate_range(address: int, nbytes: int) -> bool:
    """Fault in the whole pages of `[address, address + nbytes)` for writing; False if this kernel cannot.

    Only pages entirely inside the range are named (a partial page at either
    end may belong to another allocation); the caller's own writes touch the
    rest. The call releases the GIL (ctypes), so a thread can run it beside
    a receive.
    """
    global _madvise
    if _madvise is None:
        return False
    start, stop = _whole_pages(address, nbytes)
    if stop <= start:
        return True
    if _madvise(start, stop - start, _MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:  # a kernel older than 5.14: do not ask again
        _madvise = None
    return False


def can_populate() -> bool:
    """Whether `populate_range` works here: Linux, and a kernel that accepts the call (asked once)."""
    global _madvise, _probed
    if not _probed and _madvise is not None:
        _probed = True
        probe = (ctypes.c_char * (2 * _PAGE))()  # holds one whole page, whatever its alignment
        if not populate_range(ctypes.addressof(probe), 2 * _PAGE):
            _madvise = None  # refused (e.g. by a seccomp filter): every call would be
    return _madvise is not None
