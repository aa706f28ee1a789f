"""The model-based test of the driver's core: random legal orderings, the run's invariants after every batch.

`driver_model.play(seed)` drives `DriverCore` with a seeded random shell
(boots, late syncs, deaths, discovery changes and blips, stragglers,
finishes, late checkpoint answers, driver restarts, duplicated and
reordered messages) and checks the invariants (`docs/internals.md`, "The
invariants, as the model checks them") after every batch.
`RAY_ELASTIC_FUZZ_SCRIPTS` sets how many scripts run (5,000 in the unit
lane; `make fuzz` runs 100,000 before a release). Every seed that ever
failed is kept below as a named test.
"""

from __future__ import annotations

import os

import driver_model
import pytest

from ray_elastic.driver.core.roster import Roster

SCRIPTS = int(os.environ.get("RAY_ELASTIC_FUZZ_SCRIPTS", "5000"))
FIRST = int(os.environ.get("RAY_ELASTIC_FUZZ_FIRST_SEED", "0"))
CHUNKS = 4  # pytest-xdist spreads them over its workers


@pytest.fixture(autouse=True)
def _quiet():
    driver_model.quiet()


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_legal_orderings_keep_every_invariant(chunk):
    """A violation names its seed and its script: keep that seed below as a named test once fixed."""
    for seed in range(FIRST + chunk, FIRST + SCRIPTS, CHUNKS):
        driver_model.play(seed)


# ---- seeds that failed, each named by what it broke: all fail on the core before issue 55's fixes ------------------
# A seed replays its script only with this version of the model: a change to the model's draws re-maps them, so
# re-find them then (run the old core over the seeds). The scripts themselves are kept in test_driver_orderings.py.
def test_seed_7_a_worker_let_go_is_fenced():
    driver_model.play(7)


def test_seed_259_an_uneven_finish_keeps_rank0s_value_when_it_came_in_the_same_batch():
    driver_model.play(259)


def test_seed_744_a_straggler_let_go_as_a_member_dies_stays_while_below_min_workers():
    driver_model.play(744)


def test_seed_4927_a_newcomer_that_never_synced_is_never_rank0_while_a_holder_lives():
    driver_model.play(4927)


def test_seed_13071_the_run_is_not_failed_as_every_holder_lost_while_one_lives():
    driver_model.play(13071)


def test_seed_13901_every_rank_returning_ends_the_run():
    driver_model.play(13901)


def test_seed_123885_newcomers_ready_are_admitted_while_replacements_of_failed_boots_boot():
    driver_model.play(123885)


def test_seed_129394_a_member_dropped_by_a_durable_restart_is_told_and_the_run_ends():
    driver_model.play(129394)


# ---- the checks are real: a core with a planted bug is caught ----------------------------------------------------
def test_a_core_that_forgets_to_fence_is_caught(monkeypatch):
    monkeypatch.setattr(Roster, "is_void", lambda self, worker_id: worker_id not in self.workers)
    with pytest.raises(driver_model.Violation, match="not fenced|changed the run"):
        for seed in range(500):
            driver_model.play(seed)


def test_a_core_that_ranks_newcomers_first_is_caught(monkeypatch):
    from ray_elastic.driver.core import generations

    real = generations.assign_ranks
    monkeypatch.setattr(generations, "assign_ranks", lambda workers: real([w._replace(holds=False) for w in workers]))
    with pytest.raises(driver_model.Violation, match="rank 0 .* holds commit"):
        for seed in range(40_000):  # a rare ordering: about 1 script in a few thousand; stops at the first
            driver_model.play(seed)


def test_the_model_generates_every_message_the_shell_can_send():
    """A message type the model never sends is an ordering nobody checks: each must come from the model."""
    import typing

    from ray_elastic.driver.core import messages as m

    every = set(typing.get_args(m.Message))
    seen: set[type] = set()
    for seed in range(5000):  # stops once every type came
        seen.update(driver_model.play(seed).kinds_delivered)
        if seen >= every:
            break
    assert every - seen == set(), f"no generator in the model for {sorted(t.__name__ for t in every - seen)}"


def test_seed_17896_a_return_that_reaches_the_core_after_it_killed_that_rank_is_void():
    """The model's own error: it counted rank 0's return though the core had judged rank 0 hung earlier in the same
    batch (an activity answer that timed out) and the return was void by then."""
    driver_model.play(17896)


def test_seed_311658_a_return_after_a_drain_replaced_its_generation_still_finds_its_peers_ring_error():
    """Rank 0 returned from generation 3 while rank 1's ring broke on it ("Connection closed by peer"); rank 1's
    node was drained before the return reached the core, and the drain's new generation cleared the errors the
    core kept: the run ended DONE over an uneven finish. The errors a return checks now outlive a change."""
    driver_model.play(311658)


def test_seed_99527_an_uneven_rank_drained_whose_exit_comes_before_its_ring_error_ends_the_run_done():
    """The model's own error: rank 1 of generation 1, on a draining node, left (its exit said "removed") before
    its word that its ring broke as rank 0 returned. Its exit ended every member, so the core ended the run DONE
    with rank 0's value; the ring error after it tells the core nothing it could still act on."""
    driver_model.play(99527)
