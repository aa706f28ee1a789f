"""A ring that fails the same way in every generation ends the run with that error, not a deadlock verdict.

A backend fault hook makes every allreduce of every rank raise the same
error at once (NCCL's refusal of two ranks on one GPU, as a one-GPU machine
showed it), as a transport or a GPU that refuses the ring does. The driver
re-forms the ring once; when the next generation fails the same way, the
run fails within seconds, quoting the error and naming the rank that raised
it, and does not call it a deadlock (nothing timed out).
"""

from __future__ import annotations

import time

import pytest

from ray_elastic import ElasticTrainer
from ray_elastic.exceptions import TrainingFailedError

REFUSAL = (
    "ncclInvalidUsage: Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 1a000 "
    "(a fault hook standing for NCCL)"
)


def refused_train_fn(config: dict) -> int:
    import torch

    import ray_elastic as elastic
    from ray_elastic.collective import torch_gloo
    from ray_elastic.exceptions import HorovodInternalError

    def refuse(self, value, op=None):  # the fault hook: every allreduce of this backend fails at once
        raise HorovodInternalError(f"allreduce failed: {config['refusal']}")

    torch_gloo.TorchGlooGroup.allreduce_ = refuse
    state = elastic.ObjectState(step=0)

    @elastic.run
    def train(state) -> int:
        while state.step < 50:
            elastic.allreduce(torch.ones(4))
            state.step += 1
            state.commit()
        return state.step

    return train(state)


@pytest.mark.integration
def test_the_same_ring_error_in_two_generations_fails_the_run_quoting_it(cluster, no_leaks):
    started = time.monotonic()
    with pytest.raises(TrainingFailedError) as e:
        ElasticTrainer(
            refused_train_fn, min_workers=2, max_workers=2, config={"refusal": REFUSAL}, backend="gloo", verbose=0
        ).fit()
    text = str(e.value)
    assert "same error in two generations in a row" in text, text
    assert f"raised: 'allreduce failed: {REFUSAL}'" in text and "rank 0 (" in text, text
    assert "deadlock" not in text, text
    assert time.monotonic() - started < 60, "no collective timed out: the verdict needs no timeout"
