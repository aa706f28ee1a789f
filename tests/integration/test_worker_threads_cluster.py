"""A real worker's torch threads are the CPUs reserved for it, in a Tune trial and outside one."""

from __future__ import annotations

import pytest

from ray_elastic import ElasticTrainer


def threads_fn(config: dict) -> dict:
    import torch

    import ray_elastic as elastic

    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state):
        elastic.report({"threads": torch.get_num_threads(), "loss": 0.0})
        return {"threads": elastic.allgather_object(torch.get_num_threads())}

    return train(state)


@pytest.mark.integration
def test_a_workers_torch_threads_are_its_cpus_outside_a_trial(cluster, no_leaks):
    result = ElasticTrainer(threads_fn, 2, 2, resources_per_worker={"CPU": 2}, verbose=0).fit()
    assert result.return_value["threads"] == [2, 2]


@pytest.mark.integration
def test_a_trial_workers_torch_threads_are_the_cpus_its_reservation_holds(cluster, no_leaks, tmp_path):
    tune = pytest.importorskip("ray.tune")
    trainer = ElasticTrainer(threads_fn, 1, 1, resources_per_worker={"CPU": 2}, verbose=0)
    grid = tune.Tuner(
        trainer.as_trainable(),
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(name="threads", storage_path=str(tmp_path / "tune"), verbose=0),
    ).fit()
    assert grid.num_errors == 0, [r.error for r in grid if r.error]
    (result,) = list(grid)
    assert result.metrics["threads"] == 2, "the trial's worker ran torch on fewer threads than its reserved CPUs"
