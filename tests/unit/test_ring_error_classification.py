"""A survivor's error from FSDP2's own collectives is a ring failure, whoever registered checks or not.

FSDP2 calls the default process group (the ring) itself: its all-gather in
forward and its reduce-scatter in backward raise torch.distributed's errors as
they are. Before the driver's abandon reaches a survivor, only the ring's own
classification (`CollectiveGroup.raised`) keeps such an error from being
counted as the user's (which spends `max_failures` and drops a healthy
worker). Checked here on messages, and on the error a real FSDP2 rank raises
when its peer process dies (two processes, Gloo, no Ray).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from ray_elastic.collective.torch_dist import TorchDistGroup, is_torch_ring_error
from ray_elastic.runtime.membership import Membership


def _chained(error: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise error
        except BaseException as e:
            raise outer from e
    except BaseException as raised:  # noqa: BLE001 - returned for the test
        return raised


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4321"
        ),
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:123: Connection reset by peer"
        ),
        RuntimeError("Connection reset by peer"),
        dist.DistBackendError("wait timeout after 30000ms"),
        dist.DistNetworkError("failed to connect"),
        _chained(RuntimeError("Connection closed by peer"), RuntimeError("autograd hook failed")),
    ],
)
def test_torch_distributed_errors_are_the_rings(error):
    assert is_torch_ring_error(error)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x48 and 32x1)"),
        ValueError("Connection reset by peer"),  # not from torch's transport: a user's own ValueError
        KeyError("gloo"),
        _chained(ValueError("bad config"), RuntimeError("the loop failed")),
    ],
)
def test_a_users_error_is_not_the_rings(error):
    assert not is_torch_ring_error(error)


def _membership_on(group) -> Membership:
    membership = Membership.__new__(Membership)
    membership._ring_error_checks = []
    membership.group = group  # type: ignore[misc]
    return membership


def test_the_run_loop_takes_a_torch_ring_error_as_a_ring_failure_with_no_check_registered():
    group = TorchDistGroup.__new__(TorchDistGroup)
    group.abandoned = None
    membership = _membership_on(group)
    assert membership.ring_failure(RuntimeError("gloo/transport/tcp/pair.cc: Connection closed by peer"))
    assert membership.ring_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    group.abandoned = "worker w3 died"
    assert membership.ring_failure(RuntimeError("anything")) == "worker w3 died"


def test_a_ring_that_knows_no_such_errors_leaves_them_to_the_checks():
    membership = _membership_on(SimpleNamespace(abandoned=None, raised=lambda e: False))
    assert membership.ring_failure(RuntimeError("Connection closed by peer")) is None
    membership._ring_error_checks.append(lambda e: True)
    assert membership.ring_failure(RuntimeError("x"))


# ---- the real thing: FSDP2 at world 2, one process dies ----------------------------------------
def test_fsdp2s_error_when_its_peer_dies_is_classified_as_the_rings(tmp_path):
    script = Path(__file__).parents[1] / "support" / "fsdp_peer_death.py"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(tmp_path / "ring.store")], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    try:
        out, _ = ranks[0].communicate(timeout=120)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["kind"] != "finished", "the survivor never saw its peer die"
    assert outcome["ring"], f"the survivor's {outcome['kind']} was not taken for the ring's: {outcome['message']}"
