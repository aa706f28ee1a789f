"""Choosing a backend, without Ray: what `backend=` resolves to, the refusals before anything is spawned,
and the package importing without torch (the pygloo lane has none). The runs are in
integration/test_backends_cluster.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from ray_elastic import ElasticTrainer

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_PYGLOO = importlib.util.find_spec("pygloo") is not None


def noop(config: dict) -> None:
    return None


def test_auto_picks_torch_gloo_on_cpu_when_torch_is_installed_else_pygloo():
    trainer = ElasticTrainer(noop, 1, 1)
    assert trainer.backend == ("gloo" if HAS_TORCH else "pygloo")


@pytest.mark.skipif(not HAS_TORCH, reason="NCCL runs through torch, which this venv lacks")
def test_auto_picks_nccl_for_gpu_workers():
    assert ElasticTrainer(noop, 1, 1, resources_per_worker={"CPU": 1, "GPU": 1}).backend == "nccl"


def test_nccl_without_a_gpu_per_worker_is_refused():
    with pytest.raises(ValueError, match="GPU"):
        ElasticTrainer(noop, 1, 1, backend="nccl")


@pytest.mark.skipif(HAS_PYGLOO, reason="pygloo is installed here: the error cannot happen")
def test_pygloo_where_it_cannot_be_imported_is_refused():
    with pytest.raises(ValueError, match="Python <= 3.10"):
        ElasticTrainer(noop, 1, 1, backend="pygloo")


@pytest.mark.skipif(HAS_TORCH, reason="torch is installed here: the error cannot happen")
def test_torch_backends_without_torch_are_refused():
    for backend in ("gloo", "nccl"):
        with pytest.raises(ValueError, match="needs torch"):
            ElasticTrainer(noop, 1, 1, backend=backend, resources_per_worker={"GPU": 1})


def test_the_package_and_the_numpy_example_import_without_torch():
    """The pygloo lane has no torch: `import ray_elastic` and the example must not need it."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # makes `import torch` fail, as in a venv without it
        f"sys.path.insert(0, {str(Path(__file__).parents[2] / 'examples')!r})\n"
        "import ray_elastic, linear_regression\n"
        "from ray_elastic.collective.factory import load_backend\n"
        "import ray_elastic.collective, ray_elastic.state, ray_elastic.elastic, ray_elastic.worker_actor\n"
        "import ray_elastic.driver_actor, ray_elastic.trainer\n"
        "assert ray_elastic.ObjectState and linear_regression.train_fn\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
