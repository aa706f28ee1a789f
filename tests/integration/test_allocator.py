"""The worker's allocator settings: a step's freed blocks stay resident, so the next step faults no page in.

Each case runs in a fresh process (the settings are process-wide and made
once), counting the minor page faults of allocating and writing gradient-
sized blocks three times over: what a training step does when its
gradients are set to None between steps. No Ray needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")

BLOCKS, ELEMENTS = 32, 1024 * 1024  # 32 blocks of 4 MB, as the layers of an MLP of width 1024
PAGES = 3 * BLOCKS * ELEMENTS * 4 // 4096

SCRIPT = textwrap.dedent(
    f"""
    import resource, torch
    from ray_elastic.runtime.allocator import tune_allocator
    from ray_elastic.torch.heap import warm_heap
    tuned = tune_allocator()
    params = [torch.empty({ELEMENTS}) for _ in range({BLOCKS})]
    # torch's first call of an op keeps a few small allocations for good (its dispatch caches); made among
    # the gradients' blocks, they split the heap's free room, and up to 7 of the 96 blocks were faulted in
    # afresh (in 2 of 4 clean-clone runs). A worker has run its ops (the model's init) before it warms.
    torch.ones(8)
    warmed = warm_heap(params)  # what a newcomer's TorchState does while it boots
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        grads = [torch.ones({ELEMENTS}) for _ in params]  # every page written
        del grads
    print(tuned, warmed, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def faults(env: dict[str, str]) -> tuple[bool, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    tuned, warmed, count = out.stdout.split()
    return tuned == "True", int(warmed), int(count)


def test_a_tuned_worker_reuses_freed_gradient_blocks_without_faulting_pages_in():
    tuned, warmed, count = faults({"RAY_ELASTIC_MALLOC_TUNING": "1"})
    assert tuned
    assert warmed == BLOCKS * ELEMENTS * 4, "warm_heap faults in a block the size of each tensor"
    assert count < PAGES // 20, f"{count} page faults for {PAGES} pages written: the freed blocks were given back"


def test_with_the_tuning_turned_off_glibc_maps_every_block_afresh():
    """The premise, and the opt-out: glibc's defaults fault every page in at every allocation of these blocks."""
    tuned, warmed, count = faults({"RAY_ELASTIC_MALLOC_TUNING": "0"})
    assert not tuned and warmed == 0
    assert count > PAGES // 2, f"only {count} page faults for {PAGES} pages: glibc kept the blocks by itself"
