"""Recovery against model size: a failure and a scale-up with 10M to 300M parameters + Adam.

On a local multi-node cluster (a head without CPUs, nodes A and B of 2 CPUs
each), `ElasticTrainer(min 2, max 3)` trains an MLP of `--sizes` million
parameters (width 1024, batch 1) with `TorchState` + `DistributedOptimizer`
around Adam, committing every 2 steps. Discovery is a callable reading a JSON
file, so the benchmark decides when a host comes. One run per size:

1. Two workers on A start. Whenever the benchmark asks (always at world 2),
   both time a broadcast of `min(state, 512 MB)` from rank 0 to rank 1
   (three times, the best): the loopback bandwidth of this machine, the
   ceiling for a sync. They measure it before each scale-up and once more at
   the end. With `--workers 2` (for sizes whose three workers would not fit
   the memory: `ElasticTrainer(min 1, max 2)`), one worker on A starts, and
   the loopback is measured just after each scale-up instead.
2. Scale-up, one newcomer, `--syncs` times (3 by default): B is offered one
   slot; the newcomer boots and builds its model while A trains, then all
   three reset; each time but the last, B is then withdrawn again (a
   graceful removal). Measured each time: the reset round (the driver's
   `reset_duration` of the `hosts_added` event), the newcomer's
   `state.sync()` (time, and GB/s against the faster of the loopback
   measurements just before and just after it: this machine is shared, and
   the ceiling is the figure of a quiet moment), and the survivors' pause
   (rank 0's longest gap between steps around it, beside its median step).
   The table gives the median of the scale-ups. The share of loopback is
   also given against the median of those six broadcasts (one sync against
   a typical broadcast, rather than against the best of six), and against
   a point-to-point send of the same bytes from rank 0 to the newcomer,
   timed a few steps after its sync (three times, the best) while the
   other holder idles: the same processes, the same world, the same
   moment.
3. Failure, no newcomer: the last newcomer (the last rank) SIGKILLs itself one
   step after a commit; B is then cooling down, so the survivors (one with
   `--workers 2`) go on alone.
   Measured: the reset round (`worker_failed`'s `reset_duration`),
   SIGKILL-to-next-step (the kill's time, written by the killed process, to
   rank 0's next completed step; it includes one step) and the steps redone.

What moving the bytes costs the machine, beside the loopback broadcasts:
every rank's CPU seconds per GB moved (the newcomer's and the holders' in a
sync; both ends' in the timed broadcasts), and the share of the machine's
cores busy meanwhile (every process's, Ray's and the kernel's included).
On this 2-core machine loopback TCP is CPU-bound: a sync whose CPU per GB
matches the broadcasts', on cores already full, is at the transport's
ceiling, and its share of loopback then says how busy the rest of the
machine was.

`--link-gbit R` runs A and B as `ray start` nodes in network namespaces of
their own (tests/support/netns_cluster.py; needs root), each node's link capped at R
Gbit/s each way by a token bucket, as a NIC of that speed: every byte to the
newcomer on B crosses two capped links, while A's two ranks still talk over
A's loopback (so the broadcast at world 2 is still loopback's). The newcomer's
sync and the point-to-point just after it are then also given as shares of
the cap. On this 2-core machine loopback TCP is CPU-bound; a capped link is
where the network is the limit, as on a real cluster.

`--dtype bfloat16` makes the parameters and Adam's moments bfloat16: the
same tensors in half the bytes, so a 300M model's three workers fit this
machine's memory.

Every rank also records its commits (`state.commit()`, beside a plain
`copy_` of the same number of bytes at this process's measured copy speed)
and its peak RSS over its RSS before the model existed, in copies of the
state (model + Adam), from the start of `train_fn` (the loopback
measurement's buffer is mapped apart and left out). A size whose workers
would not fit the memory available now (about 2.5 copies of the state per
worker, as measured) is skipped and said so.

Prints a table and writes bench/results/state_size.json (or `--out NAME`).
Reports, never asserts.

    .venv/bin/python bench/state_size.py [--sizes 10,100,300] [--syncs 3] [--workers 3] [--dtype float32]
        [--link-gbit R] [--out state_size]
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray
import torch
from own_dashboard import own_dashboard
from ray.cluster_utils import Cluster
from results_file import write_results

import ray_elastic as elastic
from ray_elastic.runtime.ring_ops import group

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
from netns_cluster import NetnsCluster, unavailable_reason  # noqa: E402

GB = 1e9
CORES = psutil.cpu_count()
WIDTH = 1024
COMMIT_EVERY = 2
COPIES_PER_WORKER = 2.6  # model + Adam, its commit, the gradients (in the buckets), Ray, torch: 2.5 measured at 100M


class FileDiscovery:
    """Discovery callable: the hosts are whatever the benchmark wrote into `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> dict[str, int]:
        return json.loads(Path(self.path).read_text())


def log(workdir: str, **row) -> None:
    with open(os.path.join(workdir, f"log-{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.time(), "pid": os.getpid(), **row}) + "\n")


def peak_rss() -> float:
    """This process's peak resident memory since it started or since `forget_peak_rss()`, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) * 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def forget_peak_rss() -> None:
    """Start the peak over from the memory in use now (Linux: `clear_refs` 5), so the benchmark's buffers leave it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far, all its cores (every process, and the kernel's softirqs)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def busy_share(busy_before: float, took: float) -> float:
    """The share of the machine's cores busy over the last `took` seconds, from `machine_busy_s()` at their start."""
    return (machine_busy_s() - busy_before) / (took * CORES)


def cpu_s() -> float:
    """CPU seconds this process used so far, all its threads (Gloo's and the sync's own included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def make_model(params_m: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(
        *[torch.nn.utils.skip_init(torch.nn.Linear, WIDTH, WIDTH, dtype=dtype) for _ in range(layers)]
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.03, 0.03, generator=gen)
    return model


def copy_speed() -> float:
    """Bytes per second of `copy_` between two 256 MB tensors in this process."""
    a, b = torch.ones(64 * 2**20), torch.empty(64 * 2**20)
    b.copy_(a)
    best = min(_timed(lambda: b.copy_(a)) for _ in range(3))
    return a.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_fn(config: dict) -> int:
    torch.set_num_threads(1)
    workdir = config["workdir"]
    base_rss = psutil.Process().memory_info().rss
    dtype = getattr(torch, config["dtype"])
    model = make_model(config["params_m"], dtype)
    opt = elastic.torch.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
    # measured: the benchmark's last bandwidth request carried out (a newcomer receives it with the state)
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0, measured=0)
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = 3 * dtype.itemsize * n_params  # parameters and Adam's two moments, all of `dtype`
    bytes_per_s = copy_speed()
    top = config["top"]  # the world after a scale-up; the newcomer is its last rank
    first_step_at_top: dict[int, int] = {}

    def timed_sync(sync=state.sync) -> None:
        started, cpu, busy = time.perf_counter(), cpu_s(), machine_busy_s()
        sync()
        took = time.perf_counter() - started
        log(
            workdir,
            kind="sync",
            rank=elastic.rank(),
            size=elastic.size(),
            sync_s=took,
            agreed_s=state.last_sync.agreed_after,
            cpu_s=cpu_s() - cpu,
            machine_busy=busy_share(busy, took),
        )

    def timed_restore(restore=state.restore) -> None:
        began, started = time.time(), time.perf_counter()
        restore()
        log(workdir, kind="restore", rank=elastic.rank(), began=began, restore_s=time.perf_counter() - started)

    state.sync = timed_sync  # the run loop calls state.sync(): time it as the newcomer sees it
    state.restore = timed_restore  # and state.restore(): when the survivors noticed the failure

    def measure_bandwidth(request: int) -> None:
        # mapped on its own, not from the heap (which keeps what is freed): gone from memory when unmapped
        nbytes = min(state_bytes, 512 * 2**20)
        mapped = mmap.mmap(-1, nbytes)
        buf = torch.frombuffer(mapped, dtype=torch.float32)
        last = elastic.size() - 1
        ring = group()

        def move(t: torch.Tensor) -> None:
            if last == 1:  # a broadcast between two ranks: rank 0 to rank 1
                elastic.broadcast_(t, 0)
            elif elastic.rank() in (0, last):  # at the top world: rank 0 to the newcomer, the other holder idle
                (ring.send_async(t, last) if elastic.rank() == 0 else ring.recv_async(t, 0)).wait()

        move(buf)  # connections and pages first
        times, busy, cpu = [], [], 0.0
        for _ in range(3):
            elastic.allreduce(0)  # every rank starts together
            started, busy_before, cpu_before = time.perf_counter(), machine_busy_s(), cpu_s()
            move(buf)
            times.append(time.perf_counter() - started)
            busy.append(busy_share(busy_before, times[-1]))
            cpu += cpu_s() - cpu_before
        # both ends' CPU, to set beside a sync's: what moving these bytes costs the machine
        if elastic.rank() in (0, last):
            log(workdir, kind="bandwidth_cpu", request=request, rank=elastic.rank(), cpu_s=cpu, nbytes=3 * nbytes)
        if elastic.rank() == (0 if last == 1 else last):  # the receiver's time at the top world
            log(
                workdir,
                kind="bandwidth",
                request=request,
                bytes_per_s=nbytes / min(times),
                each_bytes_per_s=[nbytes / t for t in times],
                machine_busy_each=busy,
                size=elastic.size(),
            )
        del buf
        mapped.close()
        forget_peak_rss()  # the peak reported is training's, not this buffer's (0.43 copies of the state at 100M)

    @elastic.run
    def train(state) -> int:
        gen = torch.Generator().manual_seed(elastic.rank())
        while state.step < config["max_steps"]:
            # every rank leaves, and measures the loopback bandwidth, at the same step: agree on the files
            agreed = elastic.allreduce(2 * read_int(config["measure"]) + os.path.exists(config["stop"]), op="max")
            if agreed % 2:
                break
            if agreed // 2 > state.measured:
                if elastic.size() > 1:  # a lone survivor whose commit predates the last measurement: not again
                    measure_bandwidth(agreed // 2)
                state.measured = agreed // 2
            x = torch.randn(1, WIDTH, generator=gen, dtype=dtype)
            began, cpu_began = time.time(), cpu_s()
            copying = any(t.name == "ray_elastic-commit-copy" for t in threading.enumerate())
            opt.zero_grad()
            model(x).square().mean().backward()
            backward_done, backward_cpu = time.time(), cpu_s() - cpu_began
            opt.step()
            state.step += 1
            if elastic.size() == top and state.step <= first_step_at_top.setdefault(elastic.rank(), state.step) + 1:
                # the first two steps at the top world, every rank: where the survivors' pause at a scale-up goes
                log(workdir, kind="step", rank=elastic.rank(), step=state.step, began=began,
                    backward_done=backward_done, stepped=time.time(), backward_cpu=backward_cpu,
                    copying_at_start=copying)  # fmt: skip
            elastic.report({"step": state.step, "world_size": elastic.size()})
            if elastic.rank() == 0:
                progress = {"step": state.step, "world_size": elastic.size(), "measured": state.measured}
                Path(config["progress"]).write_text(json.dumps(progress))
            if elastic.rank() == top - 1 and os.path.exists(config["kill"]) and state.step % COMMIT_EVERY == 1:
                Path(config["killed"]).write_text(json.dumps({"time": time.time(), "step": state.step}))
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % COMMIT_EVERY == 0:
                started = time.perf_counter()
                state.commit()
                log(
                    workdir,
                    kind="commit",
                    rank=elastic.rank(),
                    commit_s=time.perf_counter() - started,
                    copy_s=state_bytes / bytes_per_s,
                    peak_over_state=(peak_rss() - base_rss) / state_bytes,
                    state_bytes=state_bytes,
                )
            else:
                state.check_host_updates()
        return state.step

    return train(state)


def read_int(path: str) -> int:
    try:
        return int(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return 0


def read_logs(workdir: str) -> list[dict]:
    rows = []
    for path in Path(workdir).glob("log-*.jsonl"):
        rows.extend(json.loads(line) for line in path.read_text().splitlines())
    return sorted(rows, key=lambda r: r["time"])


def wait_progress(path: str, what: str, predicate, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            p = json.loads(Path(path).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            p = None
        if p is not None and predicate(p):
            return p
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def pause_breakdown(logs: list[dict], last_at_base: float, killed: float, top: int) -> dict[str, list[float]]:
    """The scale-up's pause, each rank's marks in seconds after rank 0's last step before it.

    sync_began / sync_ended: its `state.sync()`; then, for its first two steps at
    the top world: began, backward_done, stepped, and (not times) the CPU seconds its
    process used in that backward and whether a background copy of its commit
    was running when the step began.
    """
    marks: dict[str, list[float]] = {}
    for r in logs:
        if r["time"] >= killed or r["time"] < last_at_base:
            continue
        if r["kind"] == "sync" and r["size"] == top:
            marks[f"rank{r['rank']} sync_began"] = [r["time"] - r["sync_s"] - last_at_base]
            marks[f"rank{r['rank']} sync_ended"] = [r["time"] - last_at_base]
        elif r["kind"] == "step":
            for mark in ("began", "backward_done", "stepped"):
                marks.setdefault(f"rank{r['rank']} {mark}", []).append(r[mark] - last_at_base)
            marks.setdefault(f"rank{r['rank']} backward_cpu_s", []).append(r["backward_cpu"])
            marks.setdefault(f"rank{r['rank']} commit_copy_running_at_start", []).append(r["copying_at_start"])
    return dict(sorted(marks.items()))


def one_size(
    params_m: int,
    node_a: str,
    node_b: str,
    workdir: str,
    scale_ups: int,
    top: int,
    dtype: str = "float32",
    link_gbit: float | None = None,
) -> dict:
    base = top - 1
    workdir = os.path.join(workdir, f"{params_m}m")
    os.makedirs(workdir)
    hosts = os.path.join(workdir, "hosts.json")
    paths = {k: os.path.join(workdir, k) for k in ("progress", "stop", "kill", "killed", "measure")}
    Path(hosts).write_text(json.dumps({node_a: base}))
    trainer = elastic.ElasticTrainer(
        train_fn,
        min_workers=base,
        max_workers=top,
        config={"params_m": params_m, "workdir": workdir, "max_steps": 10_000, "top": top, "dtype": dtype, **paths},
        discovery=FileDiscovery(hosts),
        discovery_interval=0.5,
        cooldown_range=(600, 600),
        verbose=0,
    )
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()))
    runner.start()

    requests = iter(range(1, 1000))

    def measure() -> None:
        request = next(requests)
        Path(paths["measure"]).write_text(str(request))
        wait_progress(paths["progress"], f"bandwidth measurement {request}", lambda p: p["measured"] >= request)

    try:
        wait_progress(paths["progress"], f"{base} workers training", lambda p: p["step"] >= 3)
        for k in range(scale_ups):
            if base > 1:  # the loopback broadcast needs two ranks: before the scale-up, or else just after it
                measure()
            Path(hosts).write_text(json.dumps({node_a: base, node_b: 1}))
            seen = wait_progress(paths["progress"], f"newcomer {k + 1} to join", lambda p: p["world_size"] == top)
            wait_progress(paths["progress"], f"steps at {top}", lambda p, s=seen["step"]: p["step"] >= s + 3)
            measure()  # with base 1, the broadcast; else rank 0 to the newcomer, beside the other holder
            if k < scale_ups - 1:  # B withdrawn: a graceful removal, then B is offered again
                Path(hosts).write_text(json.dumps({node_a: base}))
                seen = wait_progress(paths["progress"], "the removal", lambda p: p["world_size"] == base)
                wait_progress(paths["progress"], f"steps at {base}", lambda p, s=seen["step"]: p["step"] >= s + 2)
        Path(paths["kill"]).touch()
        seen = wait_progress(paths["progress"], "the survivors after the kill", lambda p: p["world_size"] == base)
        wait_progress(paths["progress"], f"steps at {base} again", lambda p, s=seen["step"]: p["step"] >= s + 2)
        if base > 1:
            measure()
    finally:
        Path(paths["stop"]).touch()
        runner.join(300)
    result = box["result"]
    logs = read_logs(workdir)
    times, metrics = result.metric_times, result.metrics_history
    ev_up = [e for e in result.events if e.kind == "hosts_added"]
    ev_fail = next(e for e in result.events if e.kind == "worker_failed")
    killed = json.loads(Path(paths["killed"]).read_text())
    # each scale-up: the index of the first step at the top world after one at the base world
    ups = [
        i for i in range(1, len(metrics)) if metrics[i]["world_size"] == top and metrics[i - 1]["world_size"] == base
    ]
    first_up = ups[0]
    first_removal = next((times[i] for i in range(first_up, len(metrics)) if metrics[i]["world_size"] == base), None)
    after_kill = next(i for i, t in enumerate(times) if t > killed["time"] and metrics[i]["world_size"] == base)
    steps_base = [b - a for a, b in zip(times[1:first_up], times[2:first_up], strict=False)]
    steps_top = [
        times[i + 1] - times[i]
        for i in range(len(times) - 1)
        if metrics[i]["world_size"] == metrics[i + 1]["world_size"] == top
    ]
    restores = [r for r in logs if r["kind"] == "restore" and r["began"] > killed["time"]]
    synced = max(r["time"] for r in logs if r["kind"] == "sync" and r["time"] > killed["time"] and r["size"] == base)
    syncs = [r for r in logs if r["kind"] == "sync"]
    # each newcomer's first sync, in order (one process per scale-up)
    firsts: dict[int, dict] = {}
    for r in sorted(syncs, key=lambda r: r["time"]):
        if r["size"] == top and r["rank"] == top - 1:
            firsts.setdefault(r["pid"], r)
    newcomer_syncs = list(firsts.values())
    commits = [r for r in logs if r["kind"] == "commit"]
    state_bytes = commits[0]["state_bytes"]
    first_of_request: dict[int, dict] = {}  # a rank that rolled back past a measurement measures it again
    for r in logs:
        if r["kind"] == "bandwidth" and r["size"] > 1:
            first_of_request.setdefault(r["request"], r)
    measured = [first_of_request[k] for k in sorted(first_of_request) if first_of_request[k]["size"] == max(base, 2)]
    # with base > 1, each scale-up's point-to-point loopback at the top world, rank 0 to the newcomer, just after it
    after = [first_of_request[k] for k in sorted(first_of_request) if first_of_request[k]["size"] == top > 2]
    if base == 1:  # measured after each scale-up: the first one's ceiling is the measurement after it alone
        measured = measured[:1] + measured
    bandwidths = [m["bytes_per_s"] for m in measured]
    # scale-up k's ceiling: the faster of the measurements just before and just after it (each the best of 3)
    ceilings = [max(bandwidths[k], bandwidths[k + 1]) for k in range(len(newcomer_syncs))]

    def shares(of: list[float]) -> list[float]:
        """Each newcomer's sync rate as a share of the bytes per second in `of` (one per scale-up)."""
        return [state_bytes / r["sync_s"] / bw for r, bw in zip(newcomer_syncs, of, strict=True)]

    over = shares(ceilings)
    # the same against the median of those 6 broadcasts: one sync against a typical broadcast, not the best of 6
    typical = [
        statistics.median(measured[k]["each_bytes_per_s"] + measured[k + 1]["each_bytes_per_s"])
        for k in range(len(newcomer_syncs))
    ]
    over_typical = shares(typical)
    # none with --workers 2: its broadcast after each scale-up is rank 0 -> newcomer already
    over_after = shares([m["bytes_per_s"] for m in after]) if after else []
    # with --link-gbit: against the cap of the links every byte to the newcomer crosses (bytes per second)
    link = link_gbit * 1e9 / 8 if link_gbit else None
    over_link = shares([link] * len(newcomer_syncs)) if link else []
    # from the agreement on: the transfer itself, without the wait for the survivors to reach their sync
    transfer_over = [
        state_bytes / (r["sync_s"] - r["agreed_s"]) / bw for r, bw in zip(newcomer_syncs, ceilings, strict=True)
    ]
    median_k = sorted(range(len(over)), key=over.__getitem__)[len(over) // 2]  # the median scale-up
    newcomer_sync = newcomer_syncs[median_k]

    def same_sync(newcomers: dict) -> list[dict]:
        """Every rank's record of the sync the newcomer's record `newcomers` is of."""
        return [r for r in syncs if r["size"] == top and abs(r["time"] - newcomers["time"]) < 5]

    holders_sync = [r for r in same_sync(newcomer_sync) if r["rank"] != top - 1]
    # what the transfer costs the machine: every rank's CPU per GB moved, in a sync and in the loopback broadcasts
    sync_cpu_per_gb = [sum(r["cpu_s"] for r in same_sync(first)) / (state_bytes / GB) for first in newcomer_syncs]
    broadcast_cpu: dict[int, dict[int, dict]] = {}
    for r in logs:
        if r["kind"] == "bandwidth_cpu" and r["request"] in first_of_request:
            broadcast_cpu.setdefault(r["request"], {}).setdefault(r["rank"], r)

    def cpu_per_gb(of: list[dict]) -> float | None:
        both = [broadcast_cpu.get(m["request"], {}) for m in of]
        each = [sum(r["cpu_s"] for r in b.values()) / (max(r["nbytes"] for r in b.values()) / GB) for b in both if b]
        return statistics.median(each) if each else None

    by_pid: dict[int, float] = {}
    for r in commits:
        by_pid[r["pid"]] = max(by_pid.get(r["pid"], 0.0), r["peak_over_state"])
    return {
        "params_m": params_m,
        "state_gb": state_bytes / GB,
        # the figures of the median scale-up (by the newcomer's share of the loopback), then every one's
        "loopback_broadcast_gbps": ceilings[median_k] / GB,
        "loopback_broadcast_gbps_each": [b / GB for b in bandwidths],
        "up_reset_s": ev_up[median_k].reset_duration,
        "up_reset_s_each": [e.reset_duration for e in ev_up],
        "up_newcomer_sync_s": newcomer_sync["sync_s"],
        "up_newcomer_sync_s_each": [r["sync_s"] for r in newcomer_syncs],
        "up_newcomer_gbps": state_bytes / newcomer_sync["sync_s"] / GB,
        "up_newcomer_over_loopback": over[median_k],
        "up_newcomer_over_loopback_each": over,
        "up_newcomer_over_median_loopback": statistics.median(over_typical),
        "up_newcomer_over_median_loopback_each": over_typical,
        # against rank 0 -> newcomer alone, at the top world, just after (best of 3): the same processes and moment
        "up_newcomer_over_p2p_after": statistics.median(over_after) if over_after else None,
        "up_newcomer_over_p2p_after_each": over_after,
        "p2p_after_gbps_each": [m["bytes_per_s"] / GB for m in after],
        "p2p_after_machine_busy": statistics.median(b for m in after for b in m["machine_busy_each"])
        if after
        else None,
        "link_gbit": link_gbit,
        "up_newcomer_over_link": statistics.median(over_link) if link else None,
        "up_newcomer_over_link_each": over_link,
        "p2p_after_over_link_each": [m["bytes_per_s"] / link for m in after] if link else [],
        "up_newcomer_agreed_s": newcomer_sync["agreed_s"],
        "up_newcomer_transfer_over_loopback": transfer_over[median_k],
        "up_newcomer_cpu_s": newcomer_sync["cpu_s"],
        "up_holders_sync_s": [r["sync_s"] for r in holders_sync],
        "up_holders_cpu_s": [r["cpu_s"] for r in holders_sync],
        # the machine's cores busy during the newcomer's sync, and during the loopback broadcasts (every process)
        "up_machine_busy": statistics.median(r["machine_busy"] for r in newcomer_syncs),
        "up_machine_busy_each": [r["machine_busy"] for r in newcomer_syncs],
        "loopback_machine_busy": statistics.median(b for m in measured for b in m["machine_busy_each"]),
        "up_cpu_s_per_gb": statistics.median(sync_cpu_per_gb),
        "up_cpu_s_per_gb_each": sync_cpu_per_gb,
        "loopback_cpu_s_per_gb": cpu_per_gb(measured),
        "p2p_after_cpu_s_per_gb": cpu_per_gb(after),
        "up_survivor_pause_s": statistics.median(times[i] - times[i - 1] for i in ups),
        "up_survivor_pause_s_each": [times[i] - times[i - 1] for i in ups],
        # the first scale-up's
        "up_pause_breakdown": pause_breakdown(logs, times[first_up - 1], first_removal or killed["time"], top),
        "workers": [base, top],
        f"step_s_at_{base}": statistics.median(steps_base) if steps_base else None,
        f"step_s_at_{top}": statistics.median(steps_top) if steps_top else None,
        "fail_reset_s": ev_fail.reset_duration,
        "fail_kill_to_next_step_s": times[after_kill] - killed["time"],
        # the survivors notice at their next wait on the ring: up to the rest of a step's backward after the kill
        "fail_noticed_s": min(r["began"] for r in restores) - killed["time"],
        "fail_restore_s": max(r["restore_s"] for r in restores),
        "fail_noticed_to_synced_s": synced - min(r["began"] for r in restores),
        "fail_steps_redone": killed["step"] - (metrics[after_kill]["step"] - 1),
        "commit_s": statistics.median(r["commit_s"] for r in commits),
        "commit_over_copy": statistics.median(r["commit_s"] / r["copy_s"] for r in commits),
        "worker_peak_over_state": sorted(by_pid.values()),
        "events": [(e.kind, e.world_size, e.reset_duration) for e in result.events],
    }


def memory_available(need: float, timeout: float = 60.0) -> float:
    """The memory available, once it reaches `need` or `timeout` passed (the last size's workers exit slowly)."""
    deadline = time.monotonic() + timeout
    while (available := psutil.virtual_memory().available) < need and time.monotonic() < deadline:
        time.sleep(0.5)
    return available


def run_on_netns(link_gbit: float) -> int:
    """The benchmark in a child process, on nodes A and B in network namespaces with capped links; its exit code.

    A and B are `ray start` nodes of 2 CPUs in namespaces of their own (tests/support/netns_cluster.py), each link
    capped at `link_gbit` each way: A's two ranks still talk over A's own loopback, and every byte to or from
    B crosses the capped links. The child connects with the head's token in its environment, which Ray reads
    when it loads.
    """
    cluster = NetnsCluster(num_nodes=2)
    try:
        for node in cluster.nodes:
            cluster.shape(node, link_gbit)
        ids = cluster.node_ids()
        target = f"{cluster.address},{ids[cluster.nodes[0].ip]},{ids[cluster.nodes[1].ip]}"
        child = [sys.executable, __file__, *sys.argv[1:], "--connect", target]
        return subprocess.run(child, env=cluster.env, check=False).returncode
    finally:
        cluster.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,300", help="millions of model parameters")
    parser.add_argument("--syncs", type=int, default=3, help="scale-ups (newcomers) per size; the median is shown")
    parser.add_argument(
        "--workers", type=int, default=3, help="the world after a scale-up (2 or 3); it trains at one fewer"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="of the parameters and Adam's moments: bfloat16 halves the bytes of the same tensors",
    )
    parser.add_argument(
        "--link-gbit",
        type=float,
        help="run the nodes in network namespaces, each link capped at this many Gbit/s each way (needs root)",
    )
    parser.add_argument("--out", default="state_size", help="results file name under bench/results/")
    parser.add_argument("--connect", help=argparse.SUPPRESS)  # ADDRESS,NODE_A,NODE_B: --link-gbit's child
    args = parser.parse_args()
    if args.workers not in (2, 3):
        parser.error(f"--workers must be 2 or 3 (node A has 2 CPUs, B one slot), not {args.workers}")
    if args.link_gbit is not None and args.connect is None:
        if not 0 < args.link_gbit <= 100:
            parser.error(f"--link-gbit must be in (0, 100], not {args.link_gbit:g}")
        reason = unavailable_reason()
        if reason:
            parser.error(f"--link-gbit needs network namespaces: {reason}")
        sys.exit(run_on_netns(args.link_gbit))
    cluster = None
    if args.connect is not None:  # the child of --link-gbit
        address, node_a, node_b = args.connect.split(",")
        ray.init(address=address, logging_level=logging.ERROR)
    else:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **own_dashboard()})
        a, b = cluster.add_node(num_cpus=2), cluster.add_node(num_cpus=2)
        node_a, node_b = a.node_id, b.node_id
        ray.init(address=cluster.address, logging_level=logging.ERROR)
        cluster.wait_for_nodes()
    rows, skipped = [], []
    try:
        with tempfile.TemporaryDirectory() as workdir:
            for size in [int(s) for s in args.sizes.split(",")]:
                need = args.workers * COPIES_PER_WORKER * 3 * getattr(torch, args.dtype).itemsize * size * 1e6
                available = memory_available(need)
                if need > available:
                    note = (
                        f"{size}M: skipped, {args.workers} workers need ~{need / GB:.1f} GB, "
                        f"{available / GB:.1f} GB available"
                    )
                    print(note, flush=True)
                    skipped.append(note)
                    continue
                row = one_size(
                    size, node_a, node_b, workdir, args.syncs, args.workers, args.dtype, link_gbit=args.link_gbit
                )
                rows.append(row)
                print(
                    f"{size}M ({row['state_gb']:.2f} GB): failure reset {row['fail_reset_s']:.3f} s, kill->next step "
                    f"{row['fail_kill_to_next_step_s']:.3f} s; scale-up reset {row['up_reset_s']:.3f} s, newcomer "
                    f"sync {row['up_newcomer_sync_s']:.3f} s ({row['up_newcomer_over_loopback']:.0%} of loopback; "
                    f"each scale-up: {', '.join(f'{x:.0%}' for x in row['up_newcomer_over_loopback_each'])}; "
                    f"against the median broadcast: {row['up_newcomer_over_median_loopback']:.0%}"
                    + (
                        f"; against rank 0 -> newcomer just after: {row['up_newcomer_over_p2p_after']:.0%})"
                        if row["up_newcomer_over_p2p_after"] is not None
                        else ")"
                    ),
                    flush=True,
                )
                if args.link_gbit is not None:
                    print(
                        f"  over the {args.link_gbit:g} Gbit/s links: the newcomer's sync at "
                        f"{', '.join(f'{x:.0%}' for x in row['up_newcomer_over_link_each'])} of the cap; "
                        f"rank 0 -> newcomer just after at "
                        f"{', '.join(f'{x:.0%}' for x in row['p2p_after_over_link_each'])}",
                        flush=True,
                    )
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    base = args.workers - 1
    print(f"{'params':>7} {'noticed':>8} {'restore':>8} {'noticed->synced':>15}  (failure, after the SIGKILL)")
    for r in rows:
        print(
            f"{r['params_m']:>6}M {r['fail_noticed_s']:>7.3f}s {r['fail_restore_s']:>7.4f}s "
            f"{r['fail_noticed_to_synced_s']:>14.3f}s"
        )
    print(
        f"{'params':>7} {'state':>7} {'fail reset':>10} {'kill->step':>10} {f'step@{base}':>7} {'up reset':>9} "
        f"{'newcomer':>9} {'GB/s':>6} {'loopbk':>6} {'%':>5} {'pause':>7} {'commit':>7} {'/copy':>6} {'peak/state':>14}"
    )
    for r in rows:
        print(
            f"{r['params_m']:>6}M {r['state_gb']:>5.2f}GB {r['fail_reset_s']:>9.3f}s "
            f"{r['fail_kill_to_next_step_s']:>9.3f}s {r[f'step_s_at_{base}']:>6.2f}s {r['up_reset_s']:>8.3f}s "
            f"{r['up_newcomer_sync_s']:>8.3f}s {r['up_newcomer_gbps']:>6.2f} {r['loopback_broadcast_gbps']:>6.2f} "
            f"{r['up_newcomer_over_loopback']:>5.0%} {r['up_survivor_pause_s']:>6.2f}s {r['commit_s']:>6.3f}s "
            f"{r['commit_over_copy']:>5.2f}x {'/'.join(f'{p:.2f}' for p in r['worker_peak_over_state']):>14}"
        )
    print(
        f"{'params':>7} {'newcomer':>9} {'agreed':>7} {'transfer %':>10} {'cpu':>6} {'holders sync':>13} {'cpu':>10}"
        f" {'cpu/GB sync':>11} {'loopbk':>6} {'busy sync':>9} {'loopbk':>6} {'p2p after':>9} {'%':>5}"
    )
    for r in rows:
        loopback_cpu, after = r["loopback_cpu_s_per_gb"], r["up_newcomer_over_p2p_after"]
        print(
            f"{r['params_m']:>6}M {r['up_newcomer_sync_s']:>8.3f}s {r['up_newcomer_agreed_s']:>6.3f}s "
            f"{r['up_newcomer_transfer_over_loopback']:>10.0%} {r['up_newcomer_cpu_s']:>5.2f}s "
            f"{'/'.join(f'{x:.2f}' for x in r['up_holders_sync_s']):>12}s "
            f"{'/'.join(f'{x:.2f}' for x in r['up_holders_cpu_s']):>9}s "
            f"{r['up_cpu_s_per_gb']:>10.2f}s {'-' if loopback_cpu is None else f'{loopback_cpu:.2f}s':>6} "
            f"{r['up_machine_busy']:>9.0%} {r['loopback_machine_busy']:>6.0%} "
            + (
                f"{statistics.median(r['p2p_after_gbps_each']):>7.2f}GB {after:>5.0%}"
                if after
                else f"{'-':>9} {'-':>5}"  # --workers 2: the loopback broadcast is already rank 0 -> newcomer
            )
        )
    if args.link_gbit is not None:
        print(f"{'params':>7} {'link cap':>9} {'newcomer':>9} {'of cap':>7} {'p2p after':>10} {'of cap':>7}")
        for r in rows:
            print(
                f"{r['params_m']:>6}M {r['link_gbit'] / 8:>7.2f}GB {r['up_newcomer_gbps']:>7.2f}GB "
                f"{r['up_newcomer_over_link']:>7.0%} "
                + (
                    f"{statistics.median(r['p2p_after_gbps_each']):>8.2f}GB "
                    f"{statistics.median(r['p2p_after_over_link_each']):>7.0%}"
                    if r["p2p_after_gbps_each"]
                    else f"{'-':>10} {'-':>7}"  # --workers 2: no point-to-point after the scale-up
                )
            )
    for note in skipped:
        print(note)
    write_results(
        args.out,
        rows,
        sizes=args.sizes,
        syncs=args.syncs,
        workers=args.workers,
        dtype=args.dtype,
        link_gbit=args.link_gbit,
        skipped=skipped,
        commit_every=COMMIT_EVERY,
        width=WIDTH,
    )


if __name__ == "__main__":
    main()
