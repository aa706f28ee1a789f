"""`elastic.torch.prepare_model` without Ray: pygloo is refused for a DDP `train_fn` before anything
starts (and a `train_fn` without `prepare_model` is not), and every rank skips the same host checks
between agreements. The runs are in integration/test_ddp_cluster.py.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

import ray_elastic as elastic
from ray_elastic import ElasticTrainer
from ray_elastic.trainer.preflight import refers_to

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))


def _helper_wraps(model):
    return elastic.torch.prepare_model(model)


def _train_through_helper(config):
    return _helper_wraps(config["model"])


def _train_nested(config):
    def inner():
        from ray_elastic.torch import prepare_model

        return prepare_model(config["model"])

    return inner()


def _train_plain(config):
    return config


class _CallableTrain:
    def __call__(self, config):
        return elastic.torch.prepare_model(config["model"])


@pytest.mark.parametrize(
    "fn", [_train_through_helper, _train_nested, functools.partial(_train_through_helper), _CallableTrain()]
)
def test_pygloo_is_refused_for_a_ddp_train_fn_before_anything_starts(fn):
    with pytest.raises(ValueError, match="train_fn calls prepare_model.*backend='pygloo' has none"):
        ElasticTrainer(fn, 2, 2, backend="pygloo")


def test_a_train_fn_without_prepare_model_is_not_refused_for_it():
    assert not refers_to(_train_plain, "prepare_model")
    with pytest.raises(ValueError) as info:  # this interpreter has no pygloo: the backend check speaks
        ElasticTrainer(_train_plain, 2, 2, backend="pygloo")
    assert "prepare_model" not in str(info.value)


def test_every_rank_skips_the_same_checks_between_agreements_on_a_host_change(monkeypatch):
    """Without Ray: the cadence of the DDP path's host-change agreements (`_Cadence`), for 3 ranks.

    Ranks whose checks come at different rates still skip the same checks
    (the skip comes from the summed proposals, which every rank receives);
    checks further apart than `AGREE_EVERY_S` all agree; a new generation's
    first check agrees whatever the cadence was.
    """
    from ray_elastic.torch import ddp as elastic_ddp

    now = [0.0]
    monkeypatch.setattr(elastic_ddp.time, "perf_counter", lambda: now[0])
    ranks = [elastic_ddp._Cadence() for _ in range(3)]
    clocks = [0.0, 0.0, 0.0]  # each rank's own time

    def run(steps: int, step_s: list[float]) -> list[list[bool]]:
        """Which checks agreed, per rank: the ranks step in lockstep, rank r's checks `step_s[r]` apart."""
        agreed: list[list[bool]] = [[] for _ in ranks]
        for _ in range(steps):
            due = [c.due(0) for c in ranks]
            proposals = sum(c.proposal() for c in ranks)  # what the agreement's allreduce sums
            for r, c in enumerate(ranks):
                clocks[r] += step_s[r]
                now[0] = clocks[r]
                c.agreed(proposals, len(ranks)) if due[r] else c.skipped()
                agreed[r].append(due[r])
        return agreed

    warm = run(60, [0.010, 0.0125, 0.020])
    assert warm[0] == warm[1] == warm[2], "the ranks disagree on which checks meet"
    assert warm[0][:2] == [True, True], "the first checks agree (no pace measured yet)"
    # 0.1 s of checks: 10, 8 and 5 proposed, (10 + 8 + 5) // 3 = 7 checks per agreement
    assert warm[0][-21:].count(True) == 3, f"expected one agreement in 7 checks, got {warm[0][-21:]}"
    slow = run(6, [0.2, 0.3, 0.25])  # checks further apart than AGREE_EVERY_S
    assert slow[0] == slow[1] == slow[2]
    assert slow[0][-4:] == [True] * 4, f"slow checks must all agree, got {slow[0]}"
    run(30, [0.001, 0.001, 0.001])
    assert not ranks[0].due(0), "fast checks skip"
    assert [c.due(1) for c in ranks] == [True] * 3, "a new generation's first check agrees"
