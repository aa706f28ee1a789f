"""Keeping a training step's freed memory in the heap: glibc's allocator settings for a worker process.

glibc's malloc serves a block of at least `M_MMAP_THRESHOLD` bytes (128 KB
at start; raised on its own to the largest block freed so far, up to 32 MB)
with a fresh `mmap` and unmaps it when freed, and returns the heap's free
top to the OS past `M_TRIM_THRESHOLD`. A training step frees and allocates
the same sizes every step (gradients set to None, activations, an
optimizer's temporaries), so on CPU each step can map fresh pages and fault
each 4 KB page in again: a block exactly as large as the largest one freed
stays above the threshold for good. Measured here on a 100M-parameter MLP
of equal 4 MB layers (batch 1, one thread): every backward 0.20-0.22 s with
glibc's defaults, 0.07 s with freed blocks kept. `tune_allocator` keeps
them (as tcmalloc and jemalloc do): blocks below 1 GB come from the heap,
and the heap is never trimmed below 2 GB of free top. The cost: memory a
step freed stays with the process for the next step instead of going back
to the OS; a training process's peak is reached every step anyway.

A thread other than the main one (Ray runs `train_fn` on one) allocates
from an arena of its own, made of heaps of at most 64 MB. The top pad
(`M_TOP_PAD`, 64 MB here) is the free room glibc keeps when it would
shrink or unmap one of those heaps. Measured inside Ray (`bench/throughput.py`, DDP path, 0.93M
parameters): 30-530 page faults per step and rank in the backward, in MKL
writing the weight gradients into fresh pages, without the pad; 2-23 with
it. (A plain loop of allocations on a thread of a bare process did not show
the difference, so no test holds it; the benchmark does.)

With it, a newcomer's `TorchState` faults in, during its boot, blocks the
size of its gradients and frees them (`is_tuned()` says whether that pays):
its first backward, the step the survivors wait on, takes those pages.

Workers call `tune_allocator()` when they start. `RAY_ELASTIC_MALLOC_TUNING=0`
in the workers' environment leaves glibc's defaults; on a C library other
than glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # malloc.h
_M_MMAP_THRESHOLD = -3
_M_TOP_PAD = -2
MMAP_THRESHOLD = 1 << 30  # blocks below this come from the heap
TRIM_THRESHOLD = (1 << 31) - 1  # the largest an int takes: the heap's free top is kept
TOP_PAD = 64 << 20  # what a thread's arena keeps when a heap empties (64 MB: one such heap)
ENV = "RAY_ELASTIC_MALLOC_TUNING"

_tuned = False


def tune_allocator() -> bool:
    """Keep freed blocks in the heap (glibc); True if this process's allocator is (now) tuned so."""
    global _tuned
    if _tuned:
        return True
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False  # not glibc (musl's mallopt does nothing)
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    _tuned = all(mallopt(option, value) for option, value in settings)
    if not _tuned:
        logger.debug("glibc refused the allocator thresholds; its defaults stay")
    return _tuned


def is_tuned() -> bool:
    """Whether `tune_allocator()` took effect in this process (freed blocks stay in the heap)."""
    return _tuned
