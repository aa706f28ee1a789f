"""Stragglers: one of 4 nodes drops to a third of its speed at step 100; what each system's throughput does.

4 workers on 4 one-CPU nodes of a local cluster (`ray.cluster_utils`, a
head without CPUs), the small MLP of the other benchmarks, one thread per
worker. At step 100 one node's processes (its raylet and, under it, its
worker) are put under a cgroup v1 CPU quota (`tests/support/cpu_quota.py`) of a
third of the CPU share they used over the steps before (measured from
their CPU time), so that node computes at a third of its speed: a noisy
neighbour, a throttled CPU. The run goes on for `--slow-s` seconds after,
then every rank stops at the same step (a stop file, read at each commit).
Side by side, one after the other on the same cluster:

- `evict`: `ElasticTrainer` with `DistributedOptimizer`, straggler eviction on
  (the default): the slow worker leaves gracefully, its host cools down
  (`cooldown_range`, default 10 s, doubled on each eviction) and is offered
  again;
- `keep`: the same with `evict_stragglers=False` (the straggler is reported only);
- `raytrain`: Ray Train v2's `TorchTrainer` (4 workers, `prepare_model`:
  DDP), the same model, loop and slow node;
- `healthy3`: `ElasticTrainer` with 3 workers and no slow node, the pace the
  `evict` arm should reach without the straggler (the issue's target: 0.9 of
  it within 30 s of the slowdown).

Apart (`--arms calm`, written to bench/results/straggler_calm.json): the
issue's check for false evictions, `ElasticTrainer` with 4 workers, no slow
node and a durable checkpoint every 10 commits, for `--calm-s` seconds
(600), counting the straggler events; `make soak` runs it, and an eviction
there exits non-zero.

Apart too (`--arms duties`, bench/results/straggler_duties.json): rank 0's
framework duties are not slowness. 4 workers, no slow node, steps of about
20 ms (18 ms of sleep, the same on every rank, `--step-s`, and the small
MLP's step), a commit every step and a durable checkpoint every 10
commits into a store that takes 1.5 s per write (`--store-s`): every write
outlasts the 10 steps before the next, so rank 0 waits in the writer's
`submit()` at every checkpoint and the others wait for it. Counted as in
`calm`; `make soak` runs it, and an eviction exits non-zero.

Rank 0 of each system appends `step time world` to a file every 10 steps;
steps/s are read from it: before the slowdown (steps 20-100), while slow
(from 2 s after the slowdown to the eviction, or to the end), and after
the eviction (from the end of its reset to the host's re-admission, or to
the end). A step number that goes down would be steps redone: counted.
Writes bench/results/straggler.json. Reports, never asserts.

    timeout 1200 flock /tmp/ray_cluster.lock .venv/bin/python bench/straggler.py \\
        [--slow-s 60] [--arms evict,keep,raytrain,healthy3] [--per-node 2]

With `--per-node 2` (written to bench/results/straggler_2pernode.json): 2
nodes of 2 CPUs, two workers on each, and at step 100 only rank 3's worker
process is put under the quota (a cgroup holding that process alone), so
the eviction arm's world should go from 4 to 3, not 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from own_dashboard import local_cluster
from results_file import write_results
from small_mlp import make_mlp, sgd_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from cpu_quota import CpuQuota, cluster_node_pids, tree  # noqa: E402

SLOW_AT = 100  # the step at which the node drops
WARM = 20  # steps left out of the "before" figure
BATCH = 32  # samples per worker per step (small_mlp.random_batch)
HEALTHY_S = 25.0  # how long the healthy 3-worker arm runs
SETTLE_S = 2.0  # after the slowdown and after a reset, before a phase is timed
ARMS = ("evict", "keep", "raytrain", "healthy3")


# ---- inside the workers ---------------------------------------------------------------------------------------
def _stop_step(workdir: str) -> int | None:
    try:
        return int(Path(workdir, "stop").read_text())
    except (FileNotFoundError, ValueError):
        return None


def _log(workdir: str, step: int, world: int) -> None:
    with open(Path(workdir, "progress"), "a") as f:
        f.write(f"{step} {time.time():.4f} {world}\n")


def elastic_train_fn(config: dict) -> int:
    import ray_elastic as elastic

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if config.get("store_s"):
        _slow_store(config["store_s"])
    commit_every, step_s = config.get("commit_every", 10), config.get("step_s", 0.0)
    model = make_mlp()
    opt = elastic.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0)

    @elastic.run
    def train(state) -> int:
        if config.get("pids") and state.step == 0:  # which process holds which rank, to slow one worker alone
            Path(config["dir"], f"pid-{elastic.rank()}").write_text(str(os.getpid()))
        while True:
            if step_s:  # every rank the same work per step (a larger model's compute, without its CPU)
                time.sleep(step_s)
            sgd_step(model, opt)
            state.step += 1
            if state.step % commit_every:
                state.check_host_updates()
                continue
            state.commit()
            if state.step % 10:
                continue
            if elastic.rank() == 0:
                _log(config["dir"], state.step, elastic.size())
            stop = _stop_step(config["dir"])
            if stop is not None and state.step >= stop:
                return state.step

    return train(state)


def _slow_store(seconds: float) -> None:
    """This process's checkpoint store takes `seconds` longer per write (a far object store, a slow disk)."""
    from ray_elastic.checkpoint import CheckpointStore

    write = CheckpointStore.write
    if getattr(write, "slowed", False):
        return

    def slow(self, *args, **kwargs):
        time.sleep(seconds)  # the store's latency, off the training thread (the writer's thread)
        return write(self, *args, **kwargs)

    slow.slowed = True
    CheckpointStore.write = slow


def raytrain_train_fn(config: dict) -> None:
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(make_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    context = ray.train.get_context()
    step = 0
    while True:
        sgd_step(model, opt)
        step += 1
        if step % 10:
            continue
        if context.get_world_rank() == 0:
            _log(config["dir"], step, context.get_world_size())
        stop = _stop_step(config["dir"])
        if stop is not None and step >= stop:
            return


# ---- one arm ----------------------------------------------------------------------------------------------------
def _progress(workdir: str) -> list[tuple[int, float, int]]:
    try:
        text = Path(workdir, "progress").read_text()
    except FileNotFoundError:
        return []
    return [
        (int(s), float(t), int(w)) for s, t, w in (line.split() for line in text.splitlines() if line.count(" ") == 2)
    ]


def _cpu_s(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for root in pids:
        for pid in tree(root):
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
    return total


def run_arm(
    arm: str,
    slow_node,
    slow_s: float,
    workdir: str,
    calm_s: float = 600.0,
    store_s: float = 1.5,
    step_s: float = 0.018,
    per_node: int = 1,
) -> dict:
    """Start the arm, slow the node (with `per_node` > 1: rank 3's process alone) at step 100, stop `slow_s`
    later; the progress and the events."""
    outcome: dict = {}

    def fit() -> None:
        try:
            config = {"dir": workdir, "pids": per_node > 1}
            if arm == "raytrain":
                from ray.train import RunConfig, ScalingConfig
                from ray.train.torch import TorchTrainer

                TorchTrainer(
                    raytrain_train_fn,
                    train_loop_config=config,
                    scaling_config=ScalingConfig(num_workers=4),
                    run_config=RunConfig(storage_path=os.path.join(workdir, "rt-storage")),
                ).fit()
            else:
                import ray_elastic as elastic

                world = 3 if arm == "healthy3" else 4
                options = {"evict_stragglers": arm != "keep"}
                if arm in ("calm", "duties"):
                    options.update(checkpoint_dir=os.path.join(workdir, "checkpoints"), checkpoint_every=10)
                if arm == "duties":
                    config.update(store_s=store_s, commit_every=1, step_s=step_s)
                result = elastic.ElasticTrainer(
                    elastic_train_fn, min_workers=2, max_workers=world, config=config, verbose=0, **options
                ).fit()
                outcome["events"] = [e.to_dict() for e in result.events]
        except BaseException as e:  # noqa: BLE001 - reported with the arm's figures
            outcome["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    pids = cluster_node_pids(slow_node) if per_node == 1 else []
    quota = None
    slowed_at = None
    try:
        calibration = None
        while thread.is_alive():
            time.sleep(0.05)  # polling rank 0's progress file
            rows = _progress(workdir)
            step = rows[-1][0] if rows else 0
            slows = arm not in ("healthy3", "calm", "duties")
            if calibration is None and step >= 40:
                if per_node > 1 and slows:
                    pids = [int(Path(workdir, "pid-3").read_text())]
                calibration = (_cpu_s(pids), time.monotonic())
            if slows and slowed_at is None and step >= SLOW_AT and calibration is not None:
                share = (_cpu_s(pids) - calibration[0]) / (time.monotonic() - calibration[1])
                quota = CpuQuota()
                for pid in pids:
                    if per_node > 1:
                        quota.add([pid])  # that worker process alone: its node-mate keeps its CPU
                    else:
                        quota.add_tree(pid)
                quota.set(share / 3)
                slowed_at = time.time()
                outcome["share_before"], outcome["quota_cpus"] = share, share / 3
            started = rows[0][1] if arm in ("healthy3", "calm", "duties") and rows else slowed_at
            limit = {"healthy3": HEALTHY_S, "calm": calm_s, "duties": calm_s}.get(arm, slow_s)
            if started is not None and time.time() - started > limit and _stop_step(workdir) is None:
                Path(workdir, "stop").write_text(str((step // 10 + 20) * 10))
        thread.join()
        if quota is not None:
            outcome["throttled_s"] = quota.throttled_s()
    finally:
        if quota is not None:
            quota.close()
    outcome["rows"] = _progress(workdir)
    outcome["slowed_at"] = slowed_at
    return outcome


def _rate(rows: list[tuple[int, float, int]], start: float, end: float) -> float | None:
    inside = [r for r in rows if start <= r[1] <= end]
    if len(inside) < 2 or inside[-1][1] == inside[0][1]:
        return None
    return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])


def summarize(arm: str, out: dict, healthy3: float | None) -> dict:
    rows, slowed = out["rows"], out["slowed_at"]
    row: dict = {"arm": arm, "error": out.get("error")}
    redone = sum(max(0, a[0] - b[0]) for a, b in zip(rows, rows[1:], strict=False))
    row["steps_redone"] = redone
    if arm in ("calm", "duties"):
        kinds = [e["kind"] for e in out.get("events") or []]
        row["steps_s"] = _rate(rows, rows[0][1], rows[-1][1]) if rows else None
        row["minutes"] = (rows[-1][1] - rows[0][1]) / 60 if rows else 0
        row["steps"] = rows[-1][0] if rows else 0
        row["straggler_evicted"] = kinds.count("straggler_evicted")
        row["straggler_found"] = kinds.count("straggler_found")
        row["events"] = kinds
        row["straggler_details"] = [e["detail"] for e in out.get("events") or [] if "straggler" in e["kind"]]
        return row
    if arm == "healthy3":
        row["healthy_steps_s"] = _rate(rows, rows[WARM // 10][1], rows[-1][1]) if rows else None
        return row
    at_slow = next((r[1] for r in rows if r[0] >= SLOW_AT), None)
    row["before_steps_s"] = _rate(rows, next((r[1] for r in rows if r[0] >= WARM), 0), at_slow or 0)
    events = out.get("events") or []
    evicted = [e for e in events if e["kind"] == "straggler_evicted"]
    readmitted = [e for e in events if e["kind"] == "hosts_added" and evicted and e["time"] > evicted[0]["time"]]
    end = rows[-1][1] if rows else 0
    if slowed is None:
        return row
    first_evict = evicted[0]["time"] if evicted else None
    row["slow_steps_s"] = _rate(rows, slowed + SETTLE_S, first_evict or end)
    row["slow_phase_steps_s"] = _rate(rows, slowed, end)  # the whole phase after the slowdown, re-admissions included
    row["evictions"] = len(evicted)
    row["readmissions"] = len(readmitted)
    if first_evict is not None:
        reset = evicted[0].get("reset_duration") or 0.0
        after_from = first_evict + reset + SETTLE_S
        after_to = readmitted[0]["time"] if readmitted else end
        row["evicted_after_s"] = first_evict - slowed
        row["after_steps_s"] = _rate(rows, after_from, after_to)
        row["evict_detail"] = evicted[0]["detail"]
        if healthy3:
            # the first moment after the slowdown from which 3 s of steps run at >= 0.9 of the healthy 3-worker pace
            for r in rows:
                if r[1] > slowed and (rate := _rate(rows, r[1], r[1] + 3.0)) and rate >= 0.9 * healthy3:
                    row["at_0.9_of_healthy3_after_s"] = r[1] - slowed
                    break
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slow-s", type=float, default=60.0, help="how long each arm runs after the slowdown")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"of {ARMS + ('calm',)}")
    parser.add_argument("--calm-s", type=float, default=600.0, help="how long the calm and duties arms run")
    parser.add_argument("--store-s", type=float, default=1.5, help="duties: the checkpoint store's time per write")
    parser.add_argument("--step-s", type=float, default=0.018, help="duties: each rank's extra work per step")
    parser.add_argument(
        "--per-node",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: 2 nodes of 2 CPUs, two workers on each, and one worker process slowed, not its node",
    )
    args = parser.parse_args()
    arms = [a for a in (*ARMS, "calm", "duties") if a in args.arms.split(",")]
    apart = [a for a in arms if a in ("calm", "duties")]
    if apart:
        failed = []
        for arm in apart:
            with local_cluster(nodes=4, cpus=1) as (_, nodes), tempfile.TemporaryDirectory(prefix=arm) as workdir:
                out = run_arm(arm, nodes[-1], args.slow_s, workdir, args.calm_s, args.store_s, args.step_s)
            row = summarize(arm, out, None)
            print(row)
            meta = {"calm_s": args.calm_s, "checkpoint_every": 10}
            if arm == "duties":
                meta.update(store_s=args.store_s, step_s=args.step_s, commit_every=1)
            write_results(f"straggler_{arm}", [row], **meta)
            if row["straggler_evicted"] or row["error"]:  # `make soak` runs these arms: a false eviction fails it
                failed.append(f"{arm}: {row['straggler_evicted']} eviction(s), error {row['error']}")
        if failed:
            raise SystemExit("without a slow node: " + "; ".join(failed))
        if len(apart) == len(arms):
            return
    arms = [a for a in arms if a not in apart]
    if args.per_node > 1 and "raytrain" in arms:
        raise SystemExit("--per-node 2 slows one ray-elastic worker process; leave raytrain out")
    name = "straggler" if args.per_node == 1 else f"straggler_{args.per_node}pernode"
    outs: dict[str, dict] = {}
    with local_cluster(nodes=4 // args.per_node, cpus=args.per_node) as (_, nodes):
        for arm in arms:
            with tempfile.TemporaryDirectory(prefix=f"straggler-{arm}-") as workdir:
                print(f"[{arm}] running", flush=True)
                outs[arm] = run_arm(arm, nodes[-1], args.slow_s, workdir, args.calm_s, per_node=args.per_node)
    write_results(f"{name}_raw", [], arms=outs)  # every arm's progress and events, before anything is read
    healthy3 = summarize("healthy3", outs["healthy3"], None)["healthy_steps_s"] if "healthy3" in outs else None
    rows = [summarize(arm, outs[arm], healthy3) for arm in arms]
    print(f"\n{'arm':<10} {'before':>8} {'slow':>8} {'after':>8} {'phase':>8} {'evict s':>8} {'0.9 s':>7} redone")
    for r in rows:

        def f(key: str, row: dict = r) -> str:
            v = row.get(key)
            return f"{v:8.1f}" if isinstance(v, float) else f"{'-':>8}"

        if r["arm"] == "healthy3":
            print(f"{'healthy3':<10} {f('healthy_steps_s')}   (3 workers, no slow node)")
            continue
        print(
            f"{r['arm']:<10} {f('before_steps_s')} {f('slow_steps_s')} {f('after_steps_s')} "
            f"{f('slow_phase_steps_s')} {f('evicted_after_s')} {f('at_0.9_of_healthy3_after_s')[1:]} "
            f"{r['steps_redone']}" + (f"  ERROR {r['error']}" if r["error"] else "")
        )
    for r in rows:
        if r.get("evict_detail"):
            print(f"\n[{r['arm']}] straggler_evicted: {r['evict_detail']}")
    meta = {arm: {k: v for k, v in out.items() if k not in ("rows", "events")} for arm, out in outs.items()}
    write_results(name, rows, slow_s=args.slow_s, slow_at_step=SLOW_AT, per_node=args.per_node, arms=meta)


if __name__ == "__main__":
    main()
