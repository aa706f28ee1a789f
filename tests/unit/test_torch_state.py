"""TorchState save/restore without a cluster: exact, in place, buffers reused."""

from __future__ import annotations

import threading

import pytest
import torch

from ray_elastic.torch.handler import StateHandler
from ray_elastic.torch.optimizer_handler import OptimizerHandler
from ray_elastic.torch.state import TorchState, register_handler


def make(opt_cls=torch.optim.Adam, **opt_kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = opt_cls(model.parameters(), lr=0.01, **opt_kwargs)
    return model, opt


def train_steps(model, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(16, 6, generator=g)).pow(2).mean().backward()
        opt.step()


def snapshot(model, opt):
    params = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    st = {
        i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
        for i, p in enumerate(model.parameters())
        if p in opt.state
    }
    return params, st, [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]


def assert_same(a, b):
    (pa, sa, ha), (pb, sb, hb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert sa.keys() == sb.keys()
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            x, y = sa[i][k], sb[i][k]
            assert torch.equal(x, y) if torch.is_tensor(x) else x == y
    assert ha == hb


@pytest.mark.parametrize(
    ("opt_cls", "kwargs"),
    [(torch.optim.Adam, {}), (torch.optim.SGD, {"momentum": 0.9}), (torch.optim.AdamW, {"weight_decay": 0.1})],
)
def test_restore_returns_exactly_the_committed_model_and_optimizer_state(opt_cls, kwargs):
    model, opt = make(opt_cls, **kwargs)
    state = TorchState(model=model, optimizer=opt, epoch=0)
    train_steps(model, opt, 3)
    state.epoch = 2
    state.save()
    committed = snapshot(model, opt)
    train_steps(model, opt, 4, seed=2)
    opt.param_groups[0]["lr"] = 0.5
    state.epoch = 7
    state.restore()
    assert_same(snapshot(model, opt), committed)
    assert state.epoch == 2


def test_restore_keeps_parameter_identity_and_training_continues_identically():
    model, opt = make()
    state = TorchState(model=model, optimizer=opt)
    train_steps(model, opt, 2)
    state.save()
    param_ids = [id(p) for p in model.parameters()]
    train_steps(model, opt, 3, seed=5)
    state.restore()
    assert [id(p) for p in model.parameters()] == param_ids
    assert all(p in opt.state for p in model.parameters()), "the optimizer still finds its parameters"
    # from the restored state, training matches a twin that never diverged
    twin_model, twin_opt = make()
    train_steps(twin_model, twin_opt, 2)
    train_steps(model, opt, 3, seed=9)
    train_steps(twin_model, twin_opt, 3, seed=9)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters(), strict=True))


def test_restore_to_a_commit_taken_before_the_first_step_clears_the_moments():
    model, opt = make()
    state = TorchState(model=model, optimizer=opt)  # committed with no Adam state yet
    train_steps(model, opt, 2)
    assert opt.state
    state.restore()
    assert not any(opt.state.get(p) for p in model.parameters())
    train_steps(model, opt, 1)  # and Adam starts over cleanly


def test_commit_reuses_its_buffers():
    model, opt = make()
    state = TorchState(model=model, optimizer=opt)
    train_steps(model, opt, 1)
    state.save()
    handler: OptimizerHandler = state._handlers["optimizer"]
    model_buffers = [b.data_ptr() for b in state._handlers["model"]._saved.buffers]
    opt_buffers = [b.data_ptr() for b in handler._buffers.buffers]
    train_steps(model, opt, 2)
    state.save()
    assert [b.data_ptr() for b in state._handlers["model"]._saved.buffers] == model_buffers
    assert [b.data_ptr() for b in handler._buffers.buffers] == opt_buffers


def test_user_types_get_their_registered_handler():
    class Counter:
        def __init__(self):
            self.n = 0

    class CounterHandler(StateHandler):
        def save(self):
            self.saved = self.value.n

        def restore(self):
            self.value.n = self.saved

        def sync(self):
            pass

    register_handler(Counter, CounterHandler)
    counter = Counter()
    state = TorchState(counter=counter)
    assert isinstance(state._handlers["counter"], CounterHandler)
    counter.n = 5
    state.save()
    counter.n = 9
    state.restore()
    assert counter.n == 5


def committed_after(steps: int):
    """A model and Adam trained `steps` steps and committed: (model, opt, state, the commit's snapshot)."""
    model, opt = make()
    state = TorchState(model=model, optimizer=opt)
    train_steps(model, opt, steps)
    state.save()
    return model, opt, state, snapshot(model, opt)


def test_a_restore_trades_storage_instead_of_copying_and_a_second_failure_still_returns_to_the_commit():
    model, opt, state, committed = committed_after(2)
    train_steps(model, opt, 2, seed=3)
    before = [p.data_ptr() for p in model.parameters()]
    state.restore()
    assert [p.data_ptr() for p in model.parameters()] != before, "parameters took the commit's storage"
    assert_same(snapshot(model, opt), committed)
    train_steps(model, opt, 3, seed=4)  # the next step waited for the commit's copy in the background
    state.restore()
    assert_same(snapshot(model, opt), committed)
    # the user re-points a parameter between failures (here: a view into a larger tensor of its own): the
    # restore must see it is no longer the tensor it traded with, and copy into that view instead of trading
    weight = next(model.parameters())
    backing = torch.zeros(weight.numel() + 8)
    weight.data = backing[: weight.numel()].view_as(weight)
    train_steps(model, opt, 2, seed=5)
    state.restore()
    assert_same(snapshot(model, opt), committed)
    assert weight.data_ptr() == backing.data_ptr(), "a shared storage is copied into, not traded away"
    assert torch.equal(backing[: weight.numel()], weight.detach().reshape(-1))


def test_a_restore_with_no_step_since_the_commit_moves_no_parameter_but_resets_batchnorm():
    model, opt = make()
    state = TorchState(model=model, optimizer=opt)
    train_steps(model, opt, 2)
    state.save()
    committed = snapshot(model, opt)
    ptrs = [p.data_ptr() for p in model.parameters()]
    model(torch.randn(16, 6))  # a forward pass only: BatchNorm's running statistics move, no step
    state.restore()
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert_same(snapshot(model, opt), committed)


def test_keep_live_makes_the_live_state_the_commit_and_gives_it_a_new_id():
    model, opt = make()
    state = TorchState(model=model, optimizer=opt, epoch=0)
    first = state.commit_id
    train_steps(model, opt, 2)
    state.epoch = 4
    state.keep_live()
    assert state.commit_id == first.next()
    kept = snapshot(model, opt)
    train_steps(model, opt, 2, seed=6)
    state.epoch = 9
    state.restore()
    assert_same(snapshot(model, opt), kept)
    assert state.epoch == 4


def test_every_save_gives_a_new_commit_id_and_a_loaded_checkpoint_a_new_lineage():
    model, opt = make()
    state = TorchState(model=model, optimizer=opt)
    ids = [state.commit_id]
    for _ in range(3):
        state.save()
        ids.append(state.commit_id)
    assert [i.count for i in ids] == [ids[0].count + k for k in range(4)]
    assert len({i.lineage for i in ids}) == 1
    state.restore()
    assert state.commit_id == ids[-1], "a restore returns to the last commit: same id"
    state.load_checkpoint(state.checkpoint_payload())
    assert state.commit_id.lineage != ids[0].lineage, "a loaded checkpoint is a state no other rank holds"


def held_copier(why_not_held: str) -> threading.Thread:
    """The background copy of the commit a restore started, still running (held) half a second later."""
    copiers = [t for t in threading.enumerate() if t.name == "ray_elastic-commit-copy"]
    assert copiers, "the restore should have started a background copy"
    copiers[0].join(timeout=0.5)
    assert copiers[0].is_alive(), why_not_held
    return copiers[0]


def test_the_background_copy_of_a_restored_commit_holds_off_while_a_sync_transfers():
    """A survivor's re-copy of its commit waits for the sync's sends and receives (a newcomer's page faults)."""
    from ray_elastic.torch import broadcast, copy_gate

    model, opt, state, committed = committed_after(1)
    train_steps(model, opt, 2)
    broadcast._idle.clear()  # what send_tensors_ does while it exchanges chunks
    try:
        state.restore()  # trades storages; the commit's buffers are refilled on a thread
        copy_gate.release_background_copies()  # past the reset's hold: the transfer's still holds it
        copier = held_copier("the background copy ran while a transfer was in progress")
    finally:
        broadcast._idle.set()
    copier.join(timeout=30)
    assert not copier.is_alive(), "the background copy did not finish after the transfer ended"
    assert_same(snapshot(model, opt), committed)
    train_steps(model, opt, 1)  # the step waits for the copy; the commit is whole again
    state.restore()
    assert_same(snapshot(model, opt), committed)


def test_a_restores_re_copy_of_the_commit_waits_for_the_resets_sync_and_the_commit_stays_whole():
    """The re-copy would share the cores with the ring's re-forming: it starts once the sync returned."""
    from ray_elastic.torch import copy_gate

    model, opt, state, committed = committed_after(1)
    train_steps(model, opt, 2)
    try:
        state.restore()  # trades storages; the commit's buffers are to be refilled on a thread
        copier = held_copier("the re-copy ran before the reset's sync returned")
        assert_same(snapshot(model, opt), committed)
    finally:
        copy_gate.release_background_copies()  # what the end of the sync does
    copier.join(timeout=30)
    assert not copier.is_alive(), "the re-copy did not run once the sync returned"
    train_steps(model, opt, 1)
    state.restore()
    assert_same(snapshot(model, opt), committed)


def test_an_optimizer_step_before_the_sync_returns_runs_the_held_copy_instead_of_waiting_forever():
    """A restore with no sync after it (a user's own loop): the next step lets the held copy go."""
    from ray_elastic.torch import copy_gate

    model, opt, state, committed = committed_after(1)
    train_steps(model, opt, 2)
    try:
        state.restore()
        train_steps(model, opt, 1)  # its step waits for the copy: the hold must not stop it
        state.restore()
        assert_same(snapshot(model, opt), committed)
    finally:
        copy_gate.release_background_copies()
