"""The short chaos soak (>= 10 events) on the session's cluster; `make soak` runs the long one.

Asserts the promises: the final epoch reached, every epoch's samples trained
exactly once (padding aside), bitwise-equal ranks, every fault in
`Result.events`, nothing leaked, and a final test loss within 5% of a
fault-free run with the same seed (the soak keeps the global batch fixed, so
both runs take the same optimisation steps whatever the world size).
"""

from __future__ import annotations

import pytest
from soak import loss_gap, run_soak

pytestmark = pytest.mark.integration

EPOCHS = 40  # ~900 steps: room for 10 events 40 ledger lines apart, and their recoveries


def test_short_chaos_soak_loses_and_repeats_nothing(cluster, no_leaks):
    figures = run_soak(cluster, events=10, seed=1, epochs=EPOCHS)
    assert figures["events"] >= 10
    assert figures["samples_checked"] >= EPOCHS * 1437
    gap = loss_gap(figures)
    print(f"short soak: {figures}; final test loss {gap:.1%} from a fault-free run")
    assert gap <= 0.05, f"final test loss {figures['final_loss']:.4f} vs fault-free {figures['clean_final_loss']:.4f}"
