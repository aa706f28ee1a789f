"""The short chaos soak (>= 10 events) on the session's cluster; `make soak` runs the long one.

It asserts what must hold in every run: the final epoch reached, every
epoch's samples trained exactly once, bitwise-equal ranks, every fault in
`Result.events`, nothing leaked. How close the final loss comes to a
fault-free run's depends on the world sizes the chaos happened to leave, so
this short run reports that gap, and `make soak` holds it to 5%.
"""

from __future__ import annotations

import pytest
from soak import loss_gap, run_soak

pytestmark = pytest.mark.integration


def test_short_chaos_soak_loses_and_repeats_nothing(cluster, no_leaks):
    figures = run_soak(cluster, events=10, seed=1, epochs=40)
    assert figures["events"] >= 10
    assert figures["samples_checked"] >= 40 * 1437
    print(f"short soak: {figures}; final test loss {loss_gap(figures):.1%} from a fault-free run")
