"""Bad arguments get a clear ValueError before anything is spawned (no Ray needed)."""

from __future__ import annotations

import os

import pytest
from workloads import counting_train_fn

from ray_elastic import ElasticTrainer


def make(**overrides):
    kwargs = {"train_fn": counting_train_fn, "min_workers": 2, "max_workers": 4}
    kwargs.update(overrides)
    return ElasticTrainer(**kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train_fn": "train.py"}, "train_fn must be callable"),
        ({"min_workers": 0}, "min_workers must be an integer >= 1"),
        ({"min_workers": 2.5}, "min_workers must be an integer >= 1"),
        ({"min_workers": True}, "min_workers must be an integer >= 1"),
        ({"max_workers": 1}, r"max_workers \(1\) must be >= min_workers \(2\)"),
        ({"config": [1, 2]}, "config must be a dict"),
        ({"resources_per_worker": {}}, "resources_per_worker must be a non-empty dict"),
        ({"resources_per_worker": {"CPU": -1}}, r"resources_per_worker\['CPU'\] must be a finite number >= 0"),
        ({"resources_per_worker": {"CPU": "one"}}, "must be name -> number"),
        ({"resources_per_worker": {"CPU": 0}}, "all amounts are 0"),
        ({"resources_per_worker": {"CPU": 1, "object_store_memory": 1e8}}, "cannot ask for 'object_store_memory'"),
        ({"backend": "mpi"}, "backend must be one of"),
        ({"elastic_timeout": 0}, "elastic_timeout must be a positive number"),
        ({"discovery_interval": -1}, "discovery_interval must be a positive number"),
        ({"liveness_timeout": float("inf")}, "liveness_timeout must be a positive number"),
        ({"reset_limit": -1}, "reset_limit must be an integer >= 0"),
        ({"cooldown_range": (5, 1)}, "cooldown_range must be"),
        ({"cooldown_range": 10}, "cooldown_range must be"),
        ({"discovery": 42}, "discovery must be None, a callable"),
        ({"discovery": "/no/such/script.sh"}, "does not exist"),
        ({"data_cpus": -1}, "data_cpus must be an integer >= 0"),
        ({"data_cpus": 0.5}, "data_cpus must be an integer >= 0"),
        ({"data_cpus": None}, "data_cpus must be an integer >= 0"),
        ({"data_starvation_timeout": 0}, "data_starvation_timeout must be a positive number"),
        ({"data_starvation_timeout": float("inf")}, "data_starvation_timeout must be a positive number"),
        ({"verbose": "loud"}, r"verbose must be 0 .* or 1 .*, got 'loud'"),
        ({"verbose": 2}, r"verbose must be 0 .* or 1 .*, got 2"),
        ({"verbose": None}, r"verbose must be 0 .* or 1 .*, got None"),
    ],
)
def test_bad_arguments_are_rejected_with_a_clear_message(overrides, message):
    with pytest.raises(ValueError, match=message):
        make(**overrides)


@pytest.mark.parametrize("verbose", [0, 1, False, True])
def test_verbose_takes_0_or_1(verbose):
    assert make(verbose=verbose).verbose == verbose


async def _async_train_fn(config):
    return 1


def _generator_train_fn(config):
    yield 1


@pytest.mark.parametrize("fn", [_async_train_fn, _generator_train_fn])
def test_an_async_or_generator_train_fn_is_rejected_before_anything_runs(fn):
    """Found trying it: both ended as return_value=None, the training never run."""
    with pytest.raises(ValueError, match="train_fn must be a plain function"):
        make(train_fn=fn)


def test_unpicklable_config_is_rejected_before_anything_runs():
    import threading

    with pytest.raises(ValueError, match="must be picklable"):
        make(config={"lock": threading.Lock()})


def test_non_executable_discovery_script_is_rejected(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    with pytest.raises(ValueError, match="not executable"):
        make(discovery=str(script))
    os.chmod(script, 0o755)
    assert make(discovery=str(script)).discovery == str(script)
