"""Training functions and fault injection for the integration tests.

`counting_train_fn` is a small numpy model trained with `ObjectState` and
`elastic.allreduce`; rank 0 reports every step (step, world size, its worker
id), so a test reads the whole story from `Result.metrics_history`. Faults are
declared in the config and fire once each (a marker file records that it
fired, and when), so a worker that replaces the victim does not repeat it.

A fault is `{"rank", "step", "action", "marker", "phase"}`: the rank that
fails (or "newcomer"), by `action` (sigkill, exit, raise, hang, deadlock,
stuck_in_collective, gil_busy and gil_sleep for `seconds`; kill_kv,
kill_driver and kill_both: the run's KV actor's, driver actor's or both
processes are SIGKILLed), in `phase`:
"step" (after the step's allreduce, the default; fires at exactly `step`),
or, firing the first time the phase is reached once the state's step is at
least `step`: "commit" (inside `save()`), "sync" (inside the sync
broadcast), "newcomer_sync" (a newcomer's first sync), "reset_callback",
"rendezvous" (forming the ring of a new generation). With `"shipped": True`
the fault waits until the rank's reports so far have reached the driver
(a SIGKILL loses the reports of a rank's last quarter second).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np

import ray_elastic as elastic
from ray_elastic.runtime import current

DIM = 8


def _wait_shipped() -> None:
    """Until this rank's reports so far have reached the driver: a SIGKILL, or its node's loss, loses the rest."""
    ctx = current()
    deadline = time.monotonic() + 30
    while not ctx.metrics.delivered():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ctx.worker_id}'s reports did not reach the driver within 30 s")
        time.sleep(0.01)


def _fire_faults(config: dict, step: int, phase: str = "step", newcomer: bool = False) -> None:
    for fault in config.get("faults", []):
        if fault.get("phase", "step") != phase:
            continue
        if step != fault["step"] if phase == "step" else step < fault["step"]:
            continue
        ctx = current()
        if fault["rank"] == "newcomer":
            if not newcomer:
                continue
        elif ctx.slot is None or ctx.slot.rank != fault["rank"]:
            continue
        if fault.get("shipped"):
            _wait_shipped()
        if not fault.get("repeat"):  # a repeating fault fires every time its rank reaches its step
            marker = Path(fault["marker"])
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fires once, across workers
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"time": time.time(), "worker": current().worker_id, "step": step}))
        action = fault["action"]
        if action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "exit":
            os._exit(1)
        elif action == "raise":
            raise ValueError(f"user code failed on purpose at step {step}")
        elif action == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "deadlock":
            threading.Event().wait()  # stuck in user code; the process still answers pings
        elif action == "gil_busy":  # computes in one C call that keeps the GIL: no ping is answered meanwhile
            _compute_holding_the_gil(fault["seconds"])
        elif action == "gil_sleep":  # sleeps in a C call that keeps the GIL (ctypes.PyDLL does not release it)
            ctypes.PyDLL(None).sleep(int(fault["seconds"]))
        elif action in ("kill_kv", "kill_driver", "kill_both"):  # SIGKILL a run actor's process: Ray restarts it
            import ray

            handles = {"kv": ctx.membership.kv.handle.handle, "driver": ctx.membership.driver.handle}
            for name in ("kv", "driver") if action == "kill_both" else (action[len("kill_") :],):
                os.kill(ray._private.state.actors(handles[name]._actor_id.hex())["Pid"], signal.SIGKILL)
        elif action == "stuck_in_collective":
            ctx.in_collective = True  # as if blocked in a collective its peers never enter
            threading.Event().wait()
        else:
            raise AssertionError(f"unknown fault action {action!r}")


def _compute_holding_the_gil(seconds: float) -> None:
    """About `seconds` of CPU in one C call: builtin sum over a range runs no bytecode, so it never yields the GIL."""
    started = time.thread_time()
    sum(range(2_000_000))
    per_item = (time.thread_time() - started) / 2_000_000
    sum(range(int(seconds / max(per_item, 1e-9))))


class FaultyObjectState(elastic.ObjectState):
    """ObjectState whose save and sync can fail on purpose (see the module docstring)."""

    def __init__(self, config: dict, **kwargs) -> None:
        self._config = config
        self._synced_once = False
        super().__init__(**kwargs)

    def save(self) -> None:
        if current().generation_now() is not None:  # not the constructor's first save
            _fire_faults(self._config, self.step, "commit")
        super().save()

    def sync(self) -> None:
        # a newcomer joins a running job: its first sync in a generation after the first
        newcomer = not self._synced_once and current().generation > 1
        self._synced_once = True
        _fire_faults(self._config, self.step, "newcomer_sync" if newcomer else "sync", newcomer=newcomer)
        super().sync()


def _signal_due(config: dict, step: int) -> bool:
    """At `signal_step`; with `signal_world_size`, at the first step from there on with a world of that size."""
    if "signal_world_size" not in config:
        return step == config.get("signal_step")
    return step >= config.get("signal_step", 0) and elastic.size() == config["signal_world_size"]


def counting_train_fn(config: dict) -> dict:
    """Trains until `steps`, or `extra_steps` past the first step >= `min_steps`
    at which the world has `until_world` workers.

    `signal_file`/`signal_step`: rank 0 creates the file when it reaches that
    step and its reports so far have reached the driver (the test waits on
    it, then changes the cluster), or with
    `signal_world_size` at the first step from there with that many workers; `world_signal_file`
    likewise once the world has `world_signal` workers. `payload`: the
    float32 elements of one more allreduce per step (throughput benchmarks). `deadline_s` bounds
    the run, failing it with a clear message instead of training forever.
    """
    started = time.monotonic()
    state = FaultyObjectState(config, step=0, w=np.zeros(DIM), reached_at=None, was_whole=False)
    reset_sizes: list[int] = []  # what reset callbacks saw, on this worker

    def on_reset() -> None:
        reset_sizes.append(elastic.size())
        _fire_faults(config, state.step, "reset_callback")

    state.register_reset_callbacks([on_reset])
    current().fault_hook = lambda point: _fire_faults(config, state.step, point)

    @elastic.run
    def train(state: elastic.ObjectState) -> dict:
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, DIM))
        y = x @ np.arange(DIM, dtype=np.float64)
        while True:
            if state.step >= config.get("steps", 10**9):
                break
            if elastic.size() == config.get("signal_world_size"):
                state.was_whole = True  # in the state, so every rank agrees (and a rollback keeps it)
            at_goal = "until_world" in config and elastic.size() == config["until_world"]
            if "signal_world_size" in config and not state.was_whole:
                at_goal = False  # the goal counts only after the world was whole once (the signal's world)
            if at_goal and "until_rank0_not_in" in config:  # and rank 0 is none of these workers
                rank0 = elastic.broadcast_object(current().worker_id)
                at_goal = rank0 not in config["until_rank0_not_in"]
            if at_goal and state.step >= config.get("min_steps", 0):
                if state.reached_at is None:
                    state.reached_at = state.step
                if state.step >= state.reached_at + config.get("extra_steps", 20):
                    break
            if time.monotonic() - started > config.get("deadline_s", 120):
                raise TimeoutError(f"training did not reach its goal within {config.get('deadline_s', 120)} s")
            grad = 2 * x.T @ (x @ state.w - y) / len(y)
            grad = elastic.allreduce(grad, elastic.Average)
            if config.get("payload"):  # a bigger allreduce per step, for throughput measurements
                elastic.allreduce_(np.ones(config["payload"], dtype=np.float32), elastic.Sum)
            state.w = state.w - 0.01 * grad
            state.step += 1
            elastic.report({"step": state.step, "world_size": elastic.size(), "rank0": current().worker_id})
            if config.get("signal_file") and elastic.rank() == 0 and _signal_due(config, state.step):
                signal_file = Path(config["signal_file"])
                if not signal_file.exists():  # the test changes the cluster next, perhaps rank 0's own node
                    _wait_shipped()
                    signal_file.touch()
            if config.get("world_signal_file") and elastic.size() == config["world_signal"] and elastic.rank() == 0:
                Path(config["world_signal_file"]).touch()  # the world came to that size (e.g. after a loss)
            _fire_faults(config, state.step)
            if state.step == config.get("rank0_returns_at") and elastic.rank() == 0:
                return {"steps": state.step, "rank0": current().worker_id}  # the others go on: uneven shards
            time.sleep(config.get("step_time", 0.005))  # stands for the compute of a real step
            if state.step % config.get("commit_every", 5) == 0:
                state.commit()
            else:
                state.check_host_updates()
        digest = hashlib.sha256(state.w.tobytes()).hexdigest()
        digests = elastic.allgather_object(digest)
        return {
            "steps": state.step,
            "world_size": elastic.size(),
            "digests": digests,
            "rank0": current().worker_id,
            "reset_sizes": reset_sizes,
        }

    result = train(state)
    if config.get("rank0_linger_file") and elastic.rank() == 0:  # rank 0's work after its loop (an upload, a flush)
        Path(config["rank0_linger_file"]).write_text(current().worker_id)
        time.sleep(config.get("deadline_s", 120))
    return result


class FileDiscovery:
    """Discovery from a JSON file `{host: slots}` the test rewrites."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> dict:
        with open(self.path) as f:
            return json.load(f)


class FaultHook:
    """A picklable step hook that fires the declared faults (see `_fire_faults`)."""

    def __init__(self, faults: list[dict]) -> None:
        self.faults = faults

    def __call__(self, step: int) -> None:
        _fire_faults({"faults": self.faults}, step)


def torch_checks_train_fn(config: dict) -> dict:
    """Checks of the torch helpers inside real workers; returns what rank 0 saw."""
    import torch

    import ray_elastic.torch as etorch

    rank = elastic.rank()
    torch.manual_seed(100 + rank)  # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    base = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(4, 5)
    model(x).sum().backward()
    base.step()  # rank-specific Adam moments

    def digest() -> str:
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
            for v in base.state[p].values():
                h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
        return h.hexdigest()

    before = elastic.allgather_object(digest())
    etorch.broadcast_parameters(model.state_dict())
    etorch.broadcast_optimizer_state(base)
    after = elastic.allgather_object(digest())

    # DistributedOptimizer averages the gradients of all ranks (here: accumulated over 2 passes)
    opt = etorch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=2,
        bucket_cap_mb=0.0001,  # several buckets
    )
    inputs = [torch.randn(4, 5) * (rank + 1) for _ in range(2)]
    # this rank's gradient of both passes, taken aside (`.grad` is None while the buckets are reduced)
    local = torch.autograd.grad(sum(model(x).pow(2).sum() for x in inputs), list(model.parameters()))
    expected = [elastic.allreduce(g, elastic.Average) for g in local]
    opt.zero_grad()
    for x in inputs:
        model(x).pow(2).sum().backward()
    opt.step()
    averaged_ok = all(torch.allclose(p.grad, e, atol=1e-6) for p, e in zip(model.parameters(), expected, strict=True))
    return {
        "distinct_before": len(set(before)),
        "distinct_after": len(set(after)),
        "averaged_ok": elastic.allgather_object(averaged_ok),
        "buckets": len(opt._buckets),
    }


def large_model_train_fn(config: dict) -> dict:
    """A 25.1M-parameter MLP (5 x Linear(2240, 2240)) with `DistributedOptimizer`: gradients go in several buckets.

    `kill_rank` SIGKILLs itself in the middle of backward at step `kill_step`
    (once, `marker` records when), while the buckets of the layers behind it
    are already being reduced. Returns the steps and every rank's digest.
    """
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2240, 2240) for _ in range(5)])
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)

    def mid_backward(grad):
        if state.step + 1 == config["kill_step"] and elastic.rank() == config["kill_rank"]:
            try:
                fd = os.open(config["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return grad
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({"time": time.time(), "step": state.step + 1}))
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[1].weight.register_hook(mid_backward)

    @elastic.run
    def train(state) -> dict:
        while state.step < config["steps"]:
            opt.zero_grad()
            model(torch.randn(8, 2240)).pow(2).mean().backward()
            opt.step()
            state.step += 1
            elastic.report({"step": state.step, "world_size": elastic.size()})
            if state.step % 3 == 0:
                state.commit()
            else:
                state.check_host_updates()
        digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
        return {"steps": state.step, "world_size": elastic.size(), "digests": elastic.allgather_object(digest)}

    return train(state)
