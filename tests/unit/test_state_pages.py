"""Faulting fresh memory in ahead of a receive: the pages become present, their bytes stay as they were."""

from __future__ import annotations

import mmap
import resource
import sys

import pytest
import torch

from ray_elastic.state import pages
from ray_elastic.torch.broadcast import populate


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux") or not pages.can_populate(), reason="Linux >= 5.14 only")
def test_populate_faults_fresh_pages_in_so_writing_them_faults_no_more():
    fresh = torch.empty(64 * 2**20, dtype=torch.uint8)  # large: its own mapping, untouched
    assert populate(fresh)
    before = minor_faults()
    fresh.fill_(1)
    assert minor_faults() - before < 64 * 2**20 // mmap.PAGESIZE // 10


def test_populate_leaves_the_bytes_alone_so_it_may_race_a_receive():
    t = torch.arange(3 * 2**20, dtype=torch.int32)
    expected = t.clone()
    populate(t[5:-7])  # partial pages at both ends
    assert torch.equal(t, expected)


def test_a_kernel_without_the_call_says_so_and_nothing_is_touched(monkeypatch):
    monkeypatch.setattr(pages, "_madvise", None)
    assert not pages.can_populate()
    assert not populate(torch.zeros(4 * 2**20, dtype=torch.uint8))


def _address(m: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(m))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore: Linux")
def test_resident_tells_memory_already_in_from_fresh_so_only_fresh_memory_is_faulted_in():
    size = 16 * mmap.PAGESIZE
    fresh = mmap.mmap(-1, size)
    address = _address(fresh)
    assert not pages.resident_range(address, size), "a fresh mapping: no page is in yet"
    for page in range(16):
        if page != 9:
            fresh[page * mmap.PAGESIZE] = 1
    assert not pages.resident_range(address, size), "one page still missing"
    assert pages.resident_range(address, 9 * mmap.PAGESIZE), "the pages before it are all in"
    fresh[9 * mmap.PAGESIZE] = 1
    assert pages.resident_range(address, size)
    assert pages.resident_range(address + 5, 7), "no whole page inside: nothing to fault in"


def test_without_mincore_nothing_counts_as_resident(monkeypatch):
    monkeypatch.setattr(pages, "_mincore", None)
    assert not pages.resident_range(torch.ones(2**20).data_ptr(), 4 * 2**20)
