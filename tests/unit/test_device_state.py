"""Every tensor of a state stays on its own device through a sync, a rollback, a checkpoint and a resume.

torch's `meta` device stands in for a GPU: it holds no bytes but keeps devices
apart (`torch.cat` of a meta and a CPU tensor raises, as CUDA + CPU does), and
AdamW steps meta parameters while it keeps `step` on the CPU, as on a GPU. So
a state of meta parameters, AdamW, an `ElasticSampler`, a scheduler and the
RNG spans two devices, like every real GPU loop's.
"""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ray_elastic.checkpoint import CheckpointStore
from ray_elastic.checkpoint.entries import state_entries
from ray_elastic.collective.base import CollectiveGroup, CollectiveWork, Max, Sum
from ray_elastic.runtime.checkpoint_cadence import CheckpointCadence
from ray_elastic.runtime.generation import Generation
from ray_elastic.state.sync_plan import SyncPlan
from ray_elastic.torch import broadcast, commit_buffers, handler
from ray_elastic.torch.commit_buffers import TensorBuffers
from ray_elastic.torch.optimizer_handler import OptimizerHandler
from ray_elastic.torch.sampler import ElasticSampler
from ray_elastic.torch.state import TorchState

DEADLINE_S = 20.0


class Hub:
    """What the ranks of an in-process ring share: a queue per (sender, receiver), and a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.queues = {(s, r): queue.Queue() for s in range(size) for r in range(size)}
        self.barrier = threading.Barrier(size, timeout=DEADLINE_S)
        self.slots: list = [None] * size
        self.failed = threading.Event()
        self.messages: list[tuple[int, int, str, int]] = []  # (sender, receiver, device type, bytes)


class ThreadRing(CollectiveGroup):
    """One rank of a ring whose ranks are threads of this process; a message keeps its device.

    A CPU message carries its bytes; a meta message only its size and device.
    A receive checks that it lands on the device the message was sent from:
    the two ends staged a chunk on different devices otherwise.
    """

    name = "threads"
    point_to_point = True

    def __init__(self, hub: Hub, rank: int) -> None:
        super().__init__(rank, hub.size)
        self.hub = hub

    def send_async(self, value, dst):
        if isinstance(value, np.ndarray):
            sent = ("cpu", value.nbytes, value.copy())
        else:
            nbytes = value.numel() * value.element_size()
            sent = (value.device.type, nbytes, value.clone() if value.device.type == "cpu" else None)
        self.hub.messages.append((self.rank, dst, sent[0], sent[1]))
        self.hub.queues[(self.rank, dst)].put(sent)
        return CollectiveWork()

    def recv_async(self, value, src):
        def wait() -> None:
            device, nbytes, data = self._take(src)
            mine = "cpu" if isinstance(value, np.ndarray) else value.device.type
            size = value.nbytes if isinstance(value, np.ndarray) else value.numel() * value.element_size()
            if (device, nbytes) != (mine, size):
                raise RuntimeError(f"rank {src} sent {nbytes} bytes on {device}; landing: {size} bytes on {mine}")
            if data is not None:
                value[...] = data

        return CollectiveWork(f"receive from rank {src}", wait)

    def _take(self, src):
        deadline = time.monotonic() + DEADLINE_S
        while not self.hub.failed.is_set():
            try:
                return self.hub.queues[(src, self.rank)].get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank}: no message from rank {src} in {DEADLINE_S} s") from None
        raise RuntimeError(f"rank {self.rank}: another rank failed while this one waited for rank {src}")

    def allreduce_(self, value, op=Sum):
        self.hub.slots[self.rank] = value.copy()
        self.hub.barrier.wait()
        reduce = {Sum: np.sum, Max: np.max}[op]
        result = reduce(np.stack(self.hub.slots), axis=0)
        self.hub.barrier.wait()  # every rank read the slots before any writes the next
        value[...] = result
        return value

    def broadcast_(self, value, root_rank=0):
        raise NotImplementedError

    def allgather(self, value):
        raise NotImplementedError

    def broadcast_object(self, obj, root_rank=0):
        raise NotImplementedError

    def allgather_object(self, obj):
        raise NotImplementedError

    def barrier(self) -> None:
        self.hub.barrier.wait()

    def close(self) -> None:
        pass


_THREAD = threading.local()  # the ring of the rank this thread runs (run_ranks)


class ThreadWorker:
    """A worker's runtime as a `TorchState` of `run_ranks` asks it: generation 1, on the calling thread's ring."""

    commits = 0

    def joined(self) -> Generation:
        ring = _THREAD.ring
        return Generation(1, SimpleNamespace(rank=ring.rank, size=ring.size), ring)

    def generation_now(self) -> Generation | None:
        return self.joined() if hasattr(_THREAD, "ring") else None

    def add_join_preparation(self, prepare) -> None:
        pass

    def get_lasting(self, key):
        return None

    def post_lasting(self, key, value) -> None:
        pass


def run_ranks(monkeypatch, *jobs):
    """Run `jobs[r]()` as rank r of an in-process ring, each on its own thread; re-raise the first failure.

    A `TorchState` given `worker=ThreadWorker()` syncs over its thread's ring.
    """
    hub = Hub(len(jobs))
    monkeypatch.setattr(handler, "current_ring", lambda: _THREAD.ring)  # a handler's own sync() (Horovod's helpers)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        _THREAD.ring = ThreadRing(hub, rank)
        try:
            jobs[rank]()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            hub.failed.set()
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S * 2)
        assert not t.is_alive(), "a rank of the in-process ring never finished"
    if errors:
        raise errors[0]
    return hub


def meta_loop(dataset_size: int = 40):
    """A GPU-like loop: meta parameters, AdamW (moments on meta, step on the CPU), a sampler, StepLR."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)).to("meta")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    sampler = ElasticSampler(list(range(dataset_size)), shuffle=True, seed=0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sampler, scheduler


def step(model, opt, n: int = 1) -> None:
    for _ in range(n):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()


def devices(opt, model):
    return [{k: v.device.type for k, v in opt.state[p].items()} for p in model.parameters()]


GPU_LIKE = {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}


def test_a_newcomer_receives_a_two_device_state_through_the_transfer_with_each_tensor_on_its_device(monkeypatch):
    model0, opt0, sampler0, sched0 = meta_loop()
    step(model0, opt0, 3)
    for _ in range(3):
        sched0.step()
    sampler0.set_world(0, 1)
    iter(sampler0)
    sampler0.record_batch(0, 4)
    sampler0.record_batch(1, 4)
    holder = TorchState(
        model=model0, optimizer=opt0, sampler=sampler0, scheduler=sched0, rng=True, epoch=2, worker=ThreadWorker()
    )
    assert devices(opt0, model0) == [GPU_LIKE] * 4, "torch's own placement on the meta device"

    model1, opt1, sampler1, sched1 = meta_loop()
    newcomer = TorchState(
        model=model1, optimizer=opt1, sampler=sampler1, scheduler=sched1, rng=True, epoch=0, worker=ThreadWorker()
    )

    hub = run_ranks(monkeypatch, holder.sync, newcomer.sync)

    assert newcomer.last_sync.receivers == (1,)
    assert devices(opt1, model1) == [GPU_LIKE] * 4, "received state placed by torch's rule: step on the host"
    for p0, p1 in zip(model0.parameters(), model1.parameters(), strict=True):
        assert torch.equal(opt1.state[p1]["step"], opt0.state[p0]["step"])  # host bytes came through
    assert np.array_equal(sampler1.state_dict()["bitmap"], sampler0.state_dict()["bitmap"])
    assert (sched1.last_epoch, opt1.param_groups[0]["lr"], newcomer.epoch) == (3, 0.05, 2)
    sent = {(device, nbytes) for _, _, device, nbytes in hub.messages}
    assert {"cpu", "meta"} <= {device for device, _ in sent}, "each device's tensors in messages of their own"
    step(model1, opt1)  # the newcomer trains on
    assert opt1.state[next(model1.parameters())]["step"].item() == 4.0


def test_a_newcomer_places_capturable_state_on_the_parameters_device():
    """The rule is torch's: a capturable (or fused) group keeps `step` beside its parameter."""
    model, opt, _, _ = meta_loop()
    handler = OptimizerHandler(opt)
    p = next(model.parameters())
    skeleton = {
        "tensors": [(0, "exp_avg", tuple(p.shape), torch.float32), (0, "step", (), torch.float32)],
        "values": {},
        "hyper": [{**{k: v for k, v in opt.param_groups[0].items() if k != "params"}, "capturable": True}],
    }
    handler.receive(skeleton)
    assert {k: v.device.type for k, v in opt.state[p].items()} == {"exp_avg": "meta", "step": "meta"}
    skeleton["hyper"][0]["capturable"] = False
    handler.receive(skeleton)
    assert {k: v.device.type for k, v in opt.state[p].items()} == {"exp_avg": "meta", "step": "cpu"}


class BroadcastRing:
    """Rank 1 of two for `broadcast_tensors_`: records each message's device (no transport)."""

    size, rank = 2, 1

    def __init__(self) -> None:
        self.devices: list[str] = []

    def broadcast_(self, value, root_rank=0):
        self.devices.append(value.device.type)
        return value


def test_broadcast_parameters_coalesces_per_device_and_dtype(monkeypatch):
    ring = BroadcastRing()
    monkeypatch.setattr(broadcast, "group", lambda: ring)
    tensors = [torch.zeros(3, device="meta"), torch.ones(2), torch.zeros(4, device="meta"), torch.ones(1)]
    broadcast.broadcast_tensors_(tensors)
    assert sorted(ring.devices) == ["cpu", "meta"]
    assert [t.device.type for t in tensors] == ["meta", "cpu", "meta", "cpu"]


def test_send_tensors_stages_each_packed_chunk_on_its_own_device(monkeypatch):
    """A receiver of small tensors of two devices lands each chunk on its device, and unpacks the host's bytes."""
    sent = [torch.arange(3, dtype=torch.float32), torch.zeros(5, device="meta"), torch.arange(2.0) + 7]
    landed = [torch.zeros(3), torch.zeros(5, device="meta"), torch.zeros(2)]
    plan = SyncPlan(0, holders=(0,), receivers=(1,))
    run_ranks(
        monkeypatch,
        lambda: broadcast.send_tensors_(_ring(), plan, sent),
        lambda: broadcast.send_tensors_(_ring(), SyncPlan(1, (0,), (1,)), landed),
    )
    assert torch.equal(landed[0], sent[0]) and torch.equal(landed[2], sent[2])
    assert landed[1].device.type == "meta"


def _ring():
    return _THREAD.ring


def test_rollback_copies_into_device_tensors_and_trades_storage_on_the_host():
    """Under CUDA graphs a rolled-back tensor must keep its memory; on the host the storage trade stays."""
    for device, keeps in (("meta", True), ("cpu", False)):
        model = torch.nn.Linear(4, 3).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        step(model, opt)
        state = TorchState(model=model, optimizer=opt)
        step(model, opt)
        state.save()
        step(model, opt)
        live = [model.weight, model.bias, opt.state[model.weight]["exp_avg"], opt.state[model.bias]["exp_avg_sq"]]
        storages = [t.untyped_storage()._cdata for t in live]
        state.restore()
        now = [model.weight, model.bias, opt.state[model.weight]["exp_avg"], opt.state[model.bias]["exp_avg_sq"]]
        assert [a is b for a, b in zip(live, now, strict=True)] == [True] * 4, "the user's own tensors roll back"
        kept = [t.untyped_storage()._cdata == s for t, s in zip(now, storages, strict=True)]
        assert kept == [keeps] * 4, f"on {device}: {'copied in place' if keeps else 'storage traded'} expected"
        assert devices(opt, model) == [GPU_LIKE if device == "meta" else dict.fromkeys(GPU_LIKE, "cpu")] * 2


def test_device_copies_are_queued_by_the_calling_thread_and_only_host_copies_go_to_the_background(monkeypatch):
    """On CUDA another thread's copy runs on that thread's default stream, unordered with the loop's own stream."""
    handed: list = []
    monkeypatch.setattr(TensorBuffers, "_copy_in_background", lambda self, pairs: handed.extend(pairs))
    live = [torch.zeros(4, device="meta"), torch.zeros(4)]
    buffers = TensorBuffers()
    buffers.save_later(live, guarded=[True, True])  # a newcomer's commit of what it received
    assert [b.device.type for b, _ in handed] == ["cpu"]
    handed.clear()
    buffers.touched()
    buffers.restore(live, guarded=[True, True])  # a rollback: the host's storage trade is refilled behind it
    assert [b.device.type for b, _ in handed] == ["cpu"]


@pytest.fixture
def meta_host_copies(monkeypatch):
    """The meta device holds no bytes: its device-to-host copy writes a marker, and records its sources."""
    sources: list[torch.Tensor] = []

    def copy_to_host(host: torch.Tensor, t: torch.Tensor) -> None:
        assert t.device.type == "meta" and host.device.type == "cpu"
        sources.append(t)
        host.fill_(3)

    monkeypatch.setattr(commit_buffers, "copy_to_host", copy_to_host)
    return sources


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class DeviceEma:
    """A user's object that saves itself, holding a device tensor (an EMA of the weights)."""

    def __init__(self) -> None:
        self.shadow = torch.zeros(5, device="meta")

    def state_dict(self):
        return {"shadow": self.shadow.clone()}

    def load_state_dict(self, sd):
        self.shadow.copy_(sd["shadow"])


def test_a_checkpoint_of_a_device_state_holds_host_copies_that_plain_torch_load_opens(tmp_path, meta_host_copies):
    model, opt, sampler, sched = meta_loop()
    step(model, opt, 2)
    state = TorchState(model=model, optimizer=opt, sampler=sampler, scheduler=sched, ema=DeviceEma(), rng=True)
    state.save()
    entries = state_entries(state)
    commit = [*state._handlers["model"]._saved.buffers, *state._handlers["optimizer"]._buffers.buffers]
    commit_storages = {t.untyped_storage()._cdata for t in commit if t.device.type == "meta"}
    # each host copy read from a commit buffer itself: no second copy of the state on the device
    assert {t.untyped_storage()._cdata for t in meta_host_copies} >= commit_storages

    store = CheckpointStore(str(tmp_path), keep=2)
    path = store.write(entries, {"commit": 1, "generation": 1, "world_size": 1, "run": "r"})
    files = sorted(p for p in (tmp_path / path.rsplit("/", 1)[-1]).iterdir() if p.suffix == ".pt")
    assert {f.stem for f in files} >= {"model", "optimizer", "ema", "scheduler", "sampler"}
    for f in files:
        loaded = torch.load(f, weights_only=True)  # plain torch, on a machine without the device
        assert {t.device.type for t in _tensors(loaded)} <= {"cpu"}, f"{f.name} holds device tensors"
    weights = torch.load(tmp_path / path.rsplit("/", 1)[-1] / "model.pt", weights_only=True)
    assert torch.equal(weights["0.weight"], torch.full((8, 6), 3.0))


def test_a_resume_from_checkpoint_dir_places_adamw_state_as_torch_does(tmp_path):
    # a CPU run writes the checkpoint; a GPU-like (meta) run resumes from it
    cpu_model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 2))
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=0.1)
    step(cpu_model, cpu_opt, 2)
    written = TorchState(model=cpu_model, optimizer=cpu_opt)
    CheckpointStore(str(tmp_path)).write(state_entries(written), {"commit": 5, "generation": 1, "world_size": 1})

    model, opt, _, _ = meta_loop()
    state = TorchState(model=model, optimizer=opt)
    settings = SimpleNamespace(
        checkpoint_dir=str(tmp_path), checkpoint_keep=2, checkpoint_timeout=30.0, checkpoint_every=1, run_id="r"
    )
    driver = SimpleNamespace(tell=SimpleNamespace(remote=lambda message: None))
    cadence = CheckpointCadence("w0", driver, settings)
    meta = cadence.maybe_resume(state, SimpleNamespace(rank=0, size=1), ever_synced=False)
    assert meta is not None and meta["commit"] == 5
    assert devices(opt, model) == [GPU_LIKE] * 4, "moments beside the parameters, step on the host"
    assert opt.state[next(model.parameters())]["step"].item() == 2.0
    step(model, opt)  # the resumed loop steps on
    assert opt.state[next(model.parameters())]["step"].item() == 3.0
