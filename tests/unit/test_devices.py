"""Devices as Ray Train users expect them, without a GPU: `get_device()` and `prepare_model`'s move.

`get_device()` is the GPU Ray gave the worker (found among the GPUs the
process sees), else the CPU; `prepare_model` moves the model there before
wrapping it. The GPU calls are replaced by fakes that say what a GPU
machine would.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ray_elastic.torch as etorch
from ray_elastic.torch import ddp, device


def test_without_a_gpu_the_device_is_the_cpu():
    assert etorch.get_device() == torch.device("cpu")


@pytest.fixture
def two_gpus(monkeypatch):
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return chosen


def test_the_device_is_the_gpu_ray_gave_the_worker_and_becomes_current(two_gpus, monkeypatch):
    monkeypatch.setattr(device, "ray_gpu_ids", lambda: ["7"])
    monkeypatch.setattr(device, "visible_devices", lambda: "6,7")
    slot = SimpleNamespace(local_rank=0)
    monkeypatch.setattr(device, "maybe_current", lambda: SimpleNamespace(slot=slot))
    assert etorch.get_device() == torch.device("cuda", 1)
    assert two_gpus == [torch.device("cuda", 1)]


def test_a_ray_worker_given_no_gpu_trains_on_the_cpu_even_where_gpus_are_visible(two_gpus, monkeypatch):
    monkeypatch.setattr(device, "ray_gpu_ids", lambda: [])
    monkeypatch.setattr(device, "maybe_current", lambda: SimpleNamespace(slot=None))
    assert etorch.get_device() == torch.device("cpu")


def test_prepare_model_moves_the_model_to_the_workers_device_before_wrapping(monkeypatch):
    checks: list = []
    ctx = SimpleNamespace(add_ring_error_check=checks.append, backend="gloo")  # the runtime's named methods
    monkeypatch.setattr(ddp, "current", lambda: ctx)
    monkeypatch.setattr(ddp, "get_device", lambda: torch.device("meta"))  # stands for the worker's GPU
    model = torch.nn.Linear(4, 2)
    prepared = etorch.prepare_model(model)
    assert prepared.module is model
    assert {p.device.type for p in model.parameters()} == {"meta"}
    kept = torch.nn.Linear(4, 2)
    etorch.prepare_model(kept, move_to_device=False)
    assert {p.device.type for p in kept.parameters()} == {"cpu"}
