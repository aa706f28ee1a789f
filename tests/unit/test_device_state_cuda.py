"""On a real GPU: what the meta-device tests cannot show (addresses, streams, device memory).

Skipped without CUDA; run them on a lent GPU with
`python -m pytest -q tests/unit/test_device_state_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from ray_elastic.checkpoint.entries import state_entries
from ray_elastic.torch import copy_gate
from ray_elastic.torch.state import TorchState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def adamw_on_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def train(model, opt, n: int = 1) -> None:
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(32, 256, device="cuda")).pow(2).mean().backward()
        opt.step()


def live(model, opt):
    return [t for p in model.parameters() for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]


def test_a_rollback_on_cuda_keeps_every_address_and_brings_the_commit_back():
    model, opt = adamw_on_cuda()
    train(model, opt)
    state = TorchState(model=model, optimizer=opt)
    train(model, opt)
    state.save()
    committed = [t.detach().clone() for t in live(model, opt)]
    addresses = [t.data_ptr() for t in live(model, opt)]
    train(model, opt, 2)
    state.restore()
    assert [t.data_ptr() for t in live(model, opt)] == addresses, "a CUDA graph would replay on freed memory"
    assert all(torch.equal(a, b) for a, b in zip(live(model, opt), committed, strict=True))
    assert {opt.state[p]["step"].device.type for p in model.parameters()} == {"cpu"}


def test_a_commit_made_on_the_loops_own_stream_copies_what_that_stream_computed():
    model, opt = adamw_on_cuda()
    train(model, opt)
    state = TorchState(model=model, optimizer=opt)
    train(model, opt)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side), torch.no_grad():
            torch.cuda._sleep(500_000_000)  # the loop's work still queued when the commit is asked for
            for p in model.parameters():
                p.add_(1.0)
            state.keep_live()  # a graceful interrupt's commit: the guarded tensors' copy
            expected = [p.detach().clone() for p in model.parameters()]
        buffers = state._handlers["model"]._saved
        buffers.wait()  # the next step's wait, while the loop's stream still sleeps: the copy must follow it
        torch.cuda.synchronize()
        assert all(torch.equal(b, e) for b, e in zip(buffers.buffers, expected, strict=True))
    finally:
        copy_gate.release_background_copies()  # what the reset's sync does


def test_a_checkpoint_of_a_cuda_state_takes_host_copies_and_no_device_memory():
    model, opt = adamw_on_cuda()
    train(model, opt, 2)
    state = TorchState(model=model, optimizer=opt)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    entries = state_entries(state)
    assert torch.cuda.max_memory_allocated() == before, "the checkpoint copy took device memory"
    tensors = list(entries["model"].values()) + [
        t for s in entries["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t)
    ]
    assert {t.device.type for t in tensors} == {"cpu"}
    assert torch.equal(entries["model"]["0.weight"], model[0].weight.detach().cpu())


def test_a_commit_and_rollback_with_a_grad_scaler_never_make_the_host_wait_for_the_gpu():
    """`set_sync_debug_mode("error")` raises at any operation that waits for the GPU (a scaler's `.item()` did)."""
    model, opt = adamw_on_cuda()
    scaler = torch.amp.GradScaler("cuda")

    def step() -> None:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.randn(32, 256, device="cuda")).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    step()
    state = TorchState(model=model, optimizer=opt, scaler=scaler)
    step()
    committed = scaler.get_scale()  # read here, outside the checked part
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.save()
        scaler.update(new_scale=1.0)
        state.restore()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scaler.get_scale() == committed
