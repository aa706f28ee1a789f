"""The driver's phase: the moves `phase.py` allows, the reason each records, and the run's path through them.

No Ray: `RunPhase` alone, then `DriverCore` replayed from message scripts
(`tests/unit/test_driver_core.py`'s `Script`), reading `phase_changes()` as a
developer debugging a run would.
"""

from __future__ import annotations

import itertools

import pytest
from test_driver_core import Script

from ray_elastic.driver.core import messages as m
from ray_elastic.driver.core.phase import MOVES, PhaseChange, PhaseError, RunPhase
from ray_elastic.protocol import DriverState, Finished

W, R, RS, DONE, FAILED = (
    DriverState.WAITING,
    DriverState.RUNNING,
    DriverState.RESETTING,
    DriverState.DONE,
    DriverState.FAILED,
)


def phase_in(state: DriverState) -> RunPhase:
    """A phase that reached `state` by allowed moves, at monotonic time 1.0."""
    phase = RunPhase(started_at=0.0, wall_offset=1000.0)
    for step in {W: [], R: [R], RS: [R, RS], DONE: [DONE], FAILED: [FAILED]}[state]:
        phase.move(step, "to get there", 1.0)
    return phase


def test_a_run_starts_waiting_and_its_start_is_the_first_change():
    phase = RunPhase(started_at=5.0, wall_offset=1000.0)
    assert phase.current is W and phase.since == 5.0 and not phase.is_final
    assert phase.history() == [PhaseChange(1005.0, W, W, "the run started")]


@pytest.mark.parametrize(("before", "after"), list(itertools.product([W, R, RS], list(DriverState))))
def test_every_live_move_is_allowed_exactly_as_the_table_says_and_records_its_reason(before, after):
    phase = phase_in(before)
    if after in MOVES[before]:
        phase.move(after, f"because {after.value}", 2.0)
        assert phase.current is after and phase.since == 2.0
        assert phase.history()[-1] == PhaseChange(1002.0, before, after, f"because {after.value}")
    else:
        kept = phase.history()
        with pytest.raises(PhaseError, match=f"from {before.value} to {after.value}"):
            phase.move(after, "a bug", 2.0)
        assert phase.current is before and phase.history() == kept


def test_the_table_allows_only_what_a_run_can_do():
    # waiting and running are never entered again from themselves; a reset may be superseded by a newer one
    assert W not in MOVES[W] and R not in MOVES[R] and RS in MOVES[RS]
    # a live run may always end; an ended run never moves
    assert all({DONE, FAILED} <= MOVES[p] for p in (W, R, RS))
    assert MOVES[DONE] == MOVES[FAILED] == frozenset()


@pytest.mark.parametrize("final", [DONE, FAILED])
def test_the_first_ending_wins(final):
    phase = phase_in(final)
    kept = phase.history()
    for later in DriverState:
        phase.move(later, "after the end", 3.0)
    assert phase.current is final and phase.history() == kept


def test_the_history_keeps_the_newest_changes_only():
    phase = RunPhase(started_at=0.0, wall_offset=0.0)
    phase.move(R, "generation 1 published", 1.0)
    for i in range(RunPhase.HISTORY * 3):
        phase.move(RS, f"generation {i + 2} published", float(i + 2))
    history = phase.history()
    assert len(history) == RunPhase.HISTORY
    assert history[-1].reason == f"generation {RunPhase.HISTORY * 3 + 1} published"


# ---- the run's path, through the core ----------------------------------------------------------
def moves(s: Script) -> list[tuple[DriverState, DriverState]]:
    return [(c.before, c.after) for c in s.core.phase_changes()[1:]]


def test_a_death_and_its_reset_are_each_a_move_with_its_reason():
    s = Script()
    s.start({"A": 1, "B": 1, "C": 1})
    s.send(m.WorkerDied("w3", "SIGKILL", node_alive=True))
    s.sync(s.of(m.Publish)[0])
    assert moves(s) == [(W, R), (R, RS), (RS, R)]
    start, reset, synced = s.core.phase_changes()[1:]
    assert start.reason.startswith("generation 1 published (")
    assert reset.reason.startswith("generation 2 published (")
    assert synced.reason == "every member of generation 2 synced"
    assert [c.at for c in (start, reset, synced)] == sorted(c.at for c in (start, reset, synced))


def test_falling_below_min_workers_waits_and_the_timeout_runs_from_that_move():
    s = Script(min_workers=2)
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerDied("w2", "SIGKILL", node_alive=True))
    assert s.core.state is W and s.core.generations.waiting_since == s.now
    assert moves(s)[-1] == (R, W)
    s.send(m.Tick(), after=61.0)
    assert s.core.state is FAILED
    assert s.core.phase_changes()[-1].reason == s.core.failure
    assert moves(s)[-1] == (W, FAILED)


def test_a_finished_run_moves_to_done_once():
    s = Script()
    s.start({"A": 1, "B": 1})
    s.send(m.WorkerExited("w1", Finished(rank=0, value="model")), m.WorkerExited("w2", Finished(rank=1)))
    assert s.core.state is DONE
    assert moves(s)[-1] == (R, DONE)
    assert "every member of generation 1 ended" in s.core.phase_changes()[-1].reason
    s.send(m.Stop("too late"))
    assert s.core.state is DONE and s.core.failure is None
