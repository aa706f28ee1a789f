"""The GPU suite: what the CPU suite proves, on a real GPU. Skipped as a whole where torch sees none.

Run on a lent GPU machine by bench/gpu_check.sh (with the other GPU checks,
under 8 minutes on one GPU), or alone:

    python -m pytest -q tests/gpu

Each test starts Ray runs of two workers at `{"GPU": 0.5}` (both on GPU 0,
so the ring is torch Gloo with host staging) or, where the machine has two
GPUs or more, one GPU each on NCCL.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_HERE = Path(__file__).parent
_NO_GPU = "no CUDA GPU here (torch.cuda.is_available() is False): tests/gpu runs on a GPU machine (bench/gpu_check.sh)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
            if GPUS == 0:
                item.add_marker(pytest.mark.skip(reason=_NO_GPU))


@pytest.fixture(scope="module")
def gpu_ray():
    """A local Ray instance that sees this machine's GPUs (one per module; a shared one must have a GPU)."""
    import ray

    if ray.is_initialized():
        if ray.cluster_resources().get("GPU", 0) < 1:
            pytest.skip("the Ray instance shared by this session has no GPU: run tests/gpu on its own")
        yield
        return
    ray.init(address="local", num_cpus=max(4, 2 * GPUS), num_gpus=GPUS, logging_level=logging.WARNING)
    yield
    ray.shutdown()
