"""Resources no node of the cluster can hold fail `fit()` with a clear error before anything is spawned."""

from __future__ import annotations

import pytest
from workloads import counting_train_fn

from ray_elastic import ElasticTrainer


def make(**overrides):
    kwargs = {"train_fn": counting_train_fn, "min_workers": 2, "max_workers": 4}
    kwargs.update(overrides)
    return ElasticTrainer(**kwargs)


def test_resources_no_node_can_hold_fail_before_spawning(cluster):
    from conftest import run_namespaces_alive

    with pytest.raises(ValueError, match="fits on no node of the Ray cluster"):
        make(resources_per_worker={"CPU": 64}).fit()
    assert run_namespaces_alive() == []
