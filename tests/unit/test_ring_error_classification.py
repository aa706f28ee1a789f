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

import multiprocessing
import os
import socket
from types import SimpleNamespace

import pytest
import torch
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
def _fsdp_rank(rank: int, port: int, out) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ray_elastic.collective.torch_dist import is_torch_ring_error

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=20))
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 1))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    try:
        for step in range(50):
            if rank == 1 and step == 3:
                os._exit(0)  # as a SIGKILL: no goodbye to the peer, the kernel closes the sockets
            model(torch.randn(4, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
        out.put(("finished", "", False))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((type(e).__name__, str(e)[:300], is_torch_ring_error(e)))
    os._exit(0)  # the broken process group's destructor may wait; this process is done


def test_fsdp2s_error_when_its_peer_dies_is_classified_as_the_rings():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        kind, message, ring = out.get(timeout=60)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert kind != "finished", "the survivor never saw its peer die"
    assert ring, f"the survivor's {kind} was not taken for the ring's: {message}"
