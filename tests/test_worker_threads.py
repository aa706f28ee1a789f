"""A worker's torch threads follow the CPUs reserved for it, in Tune trials and outside them.

Ray sets `OMP_NUM_THREADS` to the CPUs an actor asks of Ray, and to 1 when
it asks for none, as a trial's workers do (they run on the trial's
reservation): torch then ran one thread on a reservation of several CPUs.
"""

from __future__ import annotations

import pytest

from ray_elastic import ElasticTrainer
from ray_elastic.runtime.threads import intra_op_threads, ray_default_threads


def test_the_threads_are_the_reserved_cpus_unless_the_user_set_them():
    # a trial's worker: Ray saw no CPU request and set 1; 2 CPUs are reserved for it
    assert intra_op_threads(2.0, env_value="1", ray_default=ray_default_threads(None)) == 2
    assert intra_op_threads(2.5, env_value=None, ray_default=1) == 2
    assert intra_op_threads(0.5, env_value="1", ray_default=1) == 1, "a fraction of a CPU still runs one thread"
    assert intra_op_threads(4.0, env_value="3", ray_default=1) is None, "a value Ray would not set is the user's"
    assert intra_op_threads(4.0, env_value="1", ray_default=1, user_set=True) is None
    assert ray_default_threads(3.7) == 3 and ray_default_threads(0.0) == 1


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
