"""The short chaos soak (>= 10 events) on the session's cluster; `make soak` runs the long one."""

from __future__ import annotations

import pytest
from soak import run_soak

pytestmark = pytest.mark.integration


def test_short_chaos_soak_loses_and_repeats_nothing(cluster, no_leaks):
    figures = run_soak(cluster, events=10, seed=1, epochs=40)
    print(figures)
    assert figures["events"] >= 10
    assert figures["samples_checked"] >= 40 * 1437
    gap = abs(figures["final_loss"] - figures["clean_final_loss"]) / figures["clean_final_loss"]
    assert gap <= 0.05, f"final loss {figures['final_loss']:.4f} vs fault-free {figures['clean_final_loss']:.4f}"
