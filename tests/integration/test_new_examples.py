"""The examples a user starts from for GPUs, Ray Data and a discovery script, run as the README says.

`examples/gpu_ddp.py --smoke` trains on the CPU where no GPU is visible and on
the workers' GPUs where there are some (skipped without one); its ranks must
end bitwise equal and its loss must fall. `examples/ray_data.py --smoke`
must train every row of every epoch once (padding aside). `examples/discover.sh`
must place the workers where its pool file says.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
from pathlib import Path

import pytest
import ray

import ray_elastic as elastic

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import gpu_ddp  # noqa: E402
import ray_data  # noqa: E402

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).parents[2] / "examples"


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def summary(capsys: pytest.CaptureFixture[str]) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def losses(line: str) -> tuple[float, float]:
    first, last = line.split("loss ")[1].split(";")[0].split(" -> ")
    return float(first), float(last)


def test_the_gpu_example_runs_on_cpu_workers_where_there_is_no_gpu(cluster, no_leaks, capsys):
    assert gpu_ddp.main(["--gpus-per-worker", "0", "--smoke", "--workers", "2"]) == 0
    line = summary(capsys)
    assert re.match(r"trained on cpu \(\d workers, backend gloo\)", line), line
    assert line.endswith("ranks bitwise equal: True"), line
    first, last = losses(line)
    assert last < first, line  # a smoke run's few steps: the loss falls, by how much is the model's


@pytest.mark.skipif(_gpus() == 0, reason="no GPU visible: the GPU mode of examples/gpu_ddp.py needs one")
def test_the_gpu_example_trains_on_the_workers_gpus():
    if ray.is_initialized():
        pytest.skip("the session's Ray has no GPU: run this test alone on a GPU machine")
    ray.init(address="local", num_cpus=4, num_gpus=_gpus(), logging_level=logging.WARNING)
    try:
        workers = _gpus()
        assert gpu_ddp.main(["--gpus-per-worker", "1", "--smoke", "--workers", str(workers)]) == 0
    finally:
        ray.shutdown()


def test_the_ray_data_example_trains_every_row_of_every_epoch_once(cluster, no_leaks, capsys):
    assert ray_data.main(["--smoke", "--max-workers", "2"]) == 0
    line = summary(capsys)
    rows, padding = (json.loads(m) for m in re.findall(r"\[[\d, ]*\]", line)[:2])
    assert len(rows) == 2 and all(r == 2000 + p for r, p in zip(rows, padding, strict=True)), line
    first, last = losses(line)
    assert last < first, line


def test_the_discovery_script_places_the_workers_its_pool_file_names(cluster, no_leaks, tmp_path):
    script = tmp_path / "discover.sh"
    shutil.copy(EXAMPLES / "discover.sh", script)
    node = cluster.worker_nodes_at_start[0]
    (tmp_path / "hosts.txt").write_text(f"# the pool\n{node.node_id}:2\n")
    config = {"samples": 256, "width": 8, "lr": 3e-3, "batch_size": 32, "epochs": 1, "seed": 0}
    trainer = elastic.ElasticTrainer(gpu_ddp.train_fn, 1, 4, config=config, discovery=str(script), verbose=0)
    result = trainer.fit()
    assert len(result.return_value["digests"]) == 2, "the pool file offers 2 slots on one node"
    assert result.events[0].world_size == 2
