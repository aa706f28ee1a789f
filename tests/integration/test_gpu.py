"""A GPU training run through NCCL, end to end; skipped on machines without a GPU (docs/gpus.md).

`ElasticTrainer` with `resources_per_worker={"GPU": 1}` picks NCCL by itself;
each worker trains a small model on its GPU with `DistributedOptimizer` and
`TorchState`, commits, and the ranks must end bitwise equal. With two GPUs or
more, one worker is SIGKILLed mid-run and the survivors must go on from the
last commit. Two workers at `GPU: 0.5` share one GPU: `backend="auto"` and
"gloo" train them on Gloo with CUDA tensors staged through host memory, on
both the `DistributedOptimizer` and the `prepare_model` path, through a
SIGKILL of rank 1 at step 12 and 40 more steps, ending bitwise equal;
`backend="nccl"` fails before training, naming NCCL's rule. The NCCL
conformance cases live in tests/integration/test_conformance.py.
Run this module alone (its Ray instance must see the GPUs):

    .venv/bin/python -m pytest -q tests/integration/test_gpu.py tests/integration/test_conformance.py -k "nccl or gpu"
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
from pathlib import Path

import pytest
import ray

from ray_elastic import ElasticTrainer
from ray_elastic.exceptions import TrainingFailedError


def _gpu_count() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _gpu_count()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(GPUS == 0, reason="no GPU on this machine: run on a GPU machine (docs/gpus.md)"),
]


@pytest.fixture(scope="module")
def gpu_ray():
    if ray.is_initialized():
        if ray.cluster_resources().get("GPU", 0) < 1:
            pytest.skip("the Ray instance shared by this session has no GPU: run this module on its own")
        yield
        return
    ray.init(address="local", num_cpus=max(4, GPUS), num_gpus=GPUS, logging_level=logging.WARNING)
    yield
    ray.shutdown()


def gpu_train_fn(config: dict) -> dict:
    import hashlib
    import time

    import torch

    import ray_elastic as elastic
    import ray_elastic.torch as etorch
    from ray_elastic.runtime.ring_ops import group

    torch.manual_seed(elastic.rank())  # ranks start different: the first sync must make them equal
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if config.get("ddp"):
        model = etorch.prepare_model(model)  # moved to get_device(), then wrapped
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        model = model.to(etorch.get_device())
        opt = etorch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), named_parameters=model.named_parameters()
        )
    state = etorch.TorchState(model=model, optimizer=opt, step=0)
    device = etorch.get_device()

    @elastic.run
    def train(state) -> dict:
        # a replaced worker rejoins before training goes on, so the steps after a kill run on the full world
        deadline = time.monotonic() + 120
        while elastic.size() < config.get("world", 0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the world did not grow back to {config['world']} workers within 120 s")
            time.sleep(0.05)
            state.check_host_updates()  # raises HostsUpdatedInterrupt once the newcomer is ready
        while state.step < config["steps"]:
            gen = torch.Generator(device=device).manual_seed(1000 * state.step + elastic.rank())
            x = torch.randn(64, 16, device=device, generator=gen)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.step += 1
            elastic.report({"step": state.step, "world_size": elastic.size(), "loss": loss.item()})
            kill = config.get("kill")
            if kill and state.step == kill["step"] and elastic.rank() == kill["rank"]:
                try:
                    os.close(os.open(kill["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    os.kill(os.getpid(), signal.SIGKILL)
                except FileExistsError:
                    pass
            if state.step % 5 == 0:
                state.commit()
            else:
                state.check_host_updates()
        tensors = [*model.parameters(), *(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))]
        digest = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in tensors))
        return {
            "backend": group().name,
            "devices": elastic.allgather_object(str(next(model.parameters()).device)),
            "digests": elastic.allgather_object(digest.hexdigest()),
            "steps": state.step,
        }

    return train(state)


def test_gpu_workers_train_with_nccl_and_end_equal(gpu_ray):
    result = ElasticTrainer(
        gpu_train_fn,
        min_workers=1,
        max_workers=min(GPUS, 4),
        config={"steps": 30},
        resources_per_worker={"CPU": 1, "GPU": 1},
        verbose=0,
    ).fit()
    out = result.return_value
    assert out["backend"] == "nccl"
    assert out["steps"] == 30
    assert all(d.startswith("cuda") for d in out["devices"]), out["devices"]
    assert len(set(out["digests"])) == 1, f"ranks diverged: {out['digests']}"


@pytest.mark.skipif(GPUS == 1, reason="a kill needs two GPU workers: this machine has one GPU")
def test_gpu_run_survives_a_sigkill(gpu_ray, tmp_path: Path):
    marker = tmp_path / "killed"
    result = ElasticTrainer(
        gpu_train_fn,
        min_workers=1,
        max_workers=min(GPUS, 4),
        config={"steps": 40, "kill": {"step": 12, "rank": 1, "marker": str(marker)}},
        resources_per_worker={"CPU": 1, "GPU": 1},
        cooldown_range=(1, 3),
        collective_timeout=30,  # NCCL notices a dead peer by this timeout (docs/gpus.md)
        verbose=0,
    ).fit()
    assert marker.exists()
    assert "worker_failed" in [e.kind for e in result.events]
    out = result.return_value
    assert out["steps"] == 40
    assert len(set(out["digests"])) == 1, f"ranks diverged: {out['digests']}"


@pytest.mark.parametrize("backend", ["auto", "gloo"])
@pytest.mark.parametrize("path", ["optimizer", "ddp"])
def test_two_workers_sharing_one_gpu_train_on_gloo_through_a_sigkill_and_end_equal(
    gpu_ray, tmp_path: Path, backend: str, path: str
):
    """Two workers at GPU 0.5 share GPU 0: NCCL cannot run them (one rank per GPU), so `auto` picks Gloo with
    host staging; the first sync, the buckets and the newcomer's transfer all carry CUDA tensors."""
    marker = tmp_path / "killed"
    result = ElasticTrainer(
        gpu_train_fn,
        min_workers=1,
        max_workers=2,
        config={
            "steps": 52,
            "world": 2,
            "ddp": path == "ddp",
            "kill": {"step": 12, "rank": 1, "marker": str(marker)},
        },
        resources_per_worker={"CPU": 1, "GPU": 0.5},
        backend=backend,
        cooldown_range=(0, 1),
        collective_timeout=30,
        verbose=0,
    ).fit()
    assert marker.exists()
    assert "worker_failed" in [e.kind for e in result.events]
    changed = [e.detail for e in result.events if e.kind == "backend_changed"]
    if backend == "auto":  # the user sees why the ring is not NCCL: once per pair of ranks (the replacement's too)
        assert 1 <= len(changed) <= 2 and all("NCCL allows one rank per GPU" in c for c in changed), changed
    out = result.return_value
    assert out["backend"] == "gloo"
    assert out["steps"] == 52  # 40 steps after the kill at step 12
    assert len(out["devices"]) == 2
    assert all(d.startswith("cuda") for d in out["devices"]), out["devices"]
    assert len(set(out["digests"])) == 1, f"ranks diverged: {out['digests']}"


def test_nccl_asked_for_two_workers_on_one_gpu_fails_before_training_naming_the_rule(gpu_ray):
    with pytest.raises(TrainingFailedError) as e:
        ElasticTrainer(
            gpu_train_fn,
            min_workers=2,
            max_workers=2,
            config={"steps": 5},
            resources_per_worker={"CPU": 1, "GPU": 0.5},
            backend="nccl",
            verbose=0,
        ).fit()
    text = str(e.value)
    assert "NCCL allows one rank per GPU" in text and "share GPU" in text, text
