"""A sync over a real torch Gloo ring of 3 processes (no Ray): only the ranks that lack rank 0's commit receive.

Each process builds a `TorchGlooGroup` over one TCP store and stands in for a
worker's runtime (`group`, `joined()`, the newcomer's preparations and the run's lasting KV are all a sync
asks of it).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import queue
import time

import torch


class LastingKV:
    """The run's KV as far as rank 0's layout for newcomers goes (this process's own dict)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def post_lasting(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def get_lasting(self, key: str) -> bytes | None:
        return self.values.get(key)


class Membership:
    """What `TorchState` asks of a worker's membership: the ring, the KV, the newcomer's preparations."""

    def __init__(self, group) -> None:
        self.group = group
        self.kv = LastingKV()
        self.preparations: list = []

    def add_join_preparation(self, prepare) -> None:
        self.preparations.append(prepare)


class Runtime:
    """What `TorchState.sync` asks of a worker's runtime: the ring."""

    def __init__(self, group) -> None:
        from ray_elastic.collective.activity import ActivityMarks

        self.group = group
        self.membership = Membership(group)
        self.activity = ActivityMarks()

    def joined(self):
        from types import SimpleNamespace

        from ray_elastic.runtime.generation import Generation

        return Generation(1, SimpleNamespace(rank=self.group.rank, size=self.group.size), self.group)

    def generation_now(self):
        return self.joined()

    def add_join_preparation(self, prepare) -> None:
        self.membership.add_join_preparation(prepare)

    def post_lasting(self, key, value) -> None:
        self.membership.kv.post_lasting(key, value)

    def get_lasting(self, key):
        return self.membership.kv.get_lasting(key)


def digest(model, opt) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        for k, v in sorted(opt.state[p].items()):
            h.update(k.encode() + (v.numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()))
    h.update(repr([g["lr"] for g in opt.param_groups]).encode())
    return h.hexdigest()


def member(rank: int, size: int, store_path: str, out) -> None:
    from ring_runtime import file_store

    from ray_elastic.collective.torch_gloo import TorchGlooGroup
    from ray_elastic.runtime.process import set_current

    torch.set_num_threads(1)
    store = file_store(store_path, size)
    ring = TorchGlooGroup(store, rank, size, timeout=30)
    set_current(Runtime(ring))
    for scenario in ("failure", "newcomer"):
        out.put((scenario, rank, *one_scenario(rank, scenario)))
    ring.close()


def one_scenario(rank: int, scenario: str) -> tuple:
    from ray_elastic.torch.state import TorchState

    # a large tensor (sliced into chunks), small ones (packed), a non-contiguous one, Adam moments
    lockstep = scenario == "failure" or rank < 2
    torch.manual_seed(0 if lockstep else 100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 3), torch.nn.Linear(3, 5))
    model[2].weight = torch.nn.Parameter(torch.randn(3, 5).t())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = TorchState(model=model, optimizer=opt, epoch=0)
    state.sync()  # everyone holds rank 0's state
    if lockstep:
        # ranks 0 and 1 (and 2 in "failure") train in lockstep from the sync: equal commits
        g = torch.Generator().manual_seed(5)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 300, generator=g)).square().mean().backward()
            opt.step()
        state.epoch = 3
        state.save()
        opt.zero_grad()
        model(torch.randn(4, 300, generator=g)).square().mean().backward()
        opt.step()  # a step after the commit, then the ring "fails"
        state.restore()
    else:
        # rank 2 is a newcomer: its own model, its own commit, no Adam moments
        model[0].weight.data.fill_(1.0)
        state = TorchState(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.5), epoch=0)
        opt = state.optimizer
    held_at_the_end = holds_at_the_last_allreduce(state)
    state.sync()
    report = state.last_sync
    synced = digest(model, opt)
    state.restore()  # the commit is what this rank synced: its background copy ran, whole, after the sync
    if digest(model, opt) != synced:
        synced = "the commit differs from the synced state"
    objects = sync_objects(lockstep)
    return synced, state.epoch, report.receivers, report.received_bytes, objects, held_at_the_end


def holds_at_the_last_allreduce(state) -> list[bool]:
    """Records, at the sync's last allreduce, whether this process's commit copies were held off."""
    from ray_elastic.runtime.process import current
    from ray_elastic.torch import copy_gate

    ring, seen = current().joined().ring, []
    max_int = ring.max_int

    def recording(value: int) -> int:
        seen.append(copy_gate._resetting)
        return max_int(value)

    ring.max_int = recording
    return seen


def sync_objects(lockstep: bool) -> tuple:
    """The same for an `ObjectState`: (its epoch after the sync, who received)."""
    from ray_elastic.state import ObjectState

    objects = ObjectState(epoch=0, counts=[0] * 3)
    objects.sync()
    if lockstep:
        objects.epoch, objects.counts = 5, [1, 2, 3]
        objects.save()
        objects.epoch = 6
        objects.restore()
    else:
        objects = ObjectState(epoch=0, counts=[9] * 3)
    objects.sync()
    return objects.epoch, objects.counts, objects.last_sync.receivers


def run_world(store_path: str, size: int = 3) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, size, store_path, out)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        results = {}
        deadline = time.monotonic() + 120
        while len(results) < 2 * size:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"a member failed ({dead}) or timed out"
            try:
                scenario, rank, *rest = out.get(timeout=0.5)
            except queue.Empty:
                continue
            results[scenario, rank] = rest
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results


def test_sync_moves_state_only_to_the_ranks_that_lack_rank0s_commit(tmp_path):
    results = run_world(str(tmp_path / "ring.store"))
    for scenario in ("failure", "newcomer"):
        digests = {r: results[scenario, r][0] for r in range(3)}
        assert len(set(digests.values())) == 1, f"{scenario}: ranks differ after the sync: {digests}"
    assert all(results["failure", r][1] == 3 for r in range(3)), "every rank resumes from the commit (epoch 3)"
    assert results["failure", 0][2] == (), "after a failure, nobody receives"
    assert {results["failure", r][3] for r in range(3)} == {0}
    assert results["newcomer", 0][2] == (2,), "only the newcomer receives"
    assert results["newcomer", 0][3] == results["newcomer", 1][3] == 0
    assert all(results[s, r][4] == (5, [1, 2, 3], ()) for s, r in results if s == "failure"), results
    assert all(results[s, r][4] == (5, [1, 2, 3], (2,)) for s, r in results if s == "newcomer"), "ObjectState too"
    assert results["newcomer", 2][1] == 3, "the newcomer took rank 0's plain values (epoch)"
    assert results["newcomer", 2][5] == [True], "the newcomer's commit copy waits until every rank has received"
    params = 300 * 200 + 200 + 200 * 3 + 3 + 3 * 5 + 5
    assert results["newcomer", 2][3] >= 3 * 4 * params, "the newcomer received the model and both Adam moments"


def chunked_member(rank: int, size: int, store_path: str, out) -> None:
    """Large tensors in slices from two holders into a newcomer's fresh memory, with the toucher both ways."""
    from ring_runtime import file_store

    from ray_elastic.collective.torch_gloo import TorchGlooGroup
    from ray_elastic.state import pages
    from ray_elastic.state.sync_plan import SyncPlan
    from ray_elastic.torch.broadcast import send_tensors_

    torch.set_num_threads(1)
    store = file_store(store_path, size)
    ring = TorchGlooGroup(store, rank, size, timeout=30)
    plan = SyncPlan(rank, holders=(0, 1), receivers=(2,))
    for faults_in in (True, False):  # madvise(MADV_POPULATE_WRITE), then a toucher that writes zeros
        pages._madvise = pages._madvise if faults_in else None
        g = torch.Generator().manual_seed(7)
        shapes = [(1000, 700), (3,), (257, 1031), (5, 7), (2000, 300)]
        if rank < 2:
            tensors = [torch.randn(*s, generator=g) for s in shapes]
            tensors.append(torch.randn(300, 500, generator=g).t())  # not contiguous
        else:
            tensors = [torch.empty(*s) for s in shapes] + [torch.empty(500, 300)]
        received = send_tensors_(ring, plan, tensors, chunk_bytes=64 * 2**10)
        digests = [hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for t in tensors]
        out.put((faults_in, rank, received, digests))
    ring.close()


def test_a_newcomer_receives_large_tensors_in_slices_bitwise_whether_its_pages_are_faulted_in_or_written(tmp_path):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=chunked_member, args=(r, 3, str(tmp_path / "ring.store"), out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        results = {}
        deadline = time.monotonic() + 120
        while len(results) < 6:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead and time.monotonic() < deadline, f"a member failed ({dead}) or timed out"
            try:
                faults_in, rank, *rest = out.get(timeout=0.5)
            except queue.Empty:
                continue
            results[faults_in, rank] = rest
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for faults_in in (True, False):
        assert results[faults_in, 0][1] == results[faults_in, 1][1] == results[faults_in, 2][1]
        assert results[faults_in, 2][0] == 4 * (700_000 + 3 + 257 * 1031 + 35 + 600_000 + 150_000)
        assert results[faults_in, 0][0] == results[faults_in, 1][0] == 0
