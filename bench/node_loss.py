"""Node loss on a cluster of distinct IPs: a silent partition, a SIGKILL, a drain notice; throughput vs loopback.

The cluster is the test suite's multi-IP one (tests/support/netns_cluster.py): a
`ray start` head on a bridge, two worker nodes of 2 CPUs, each in its own
network namespace with its own address; 4 workers, 2 per node, train
`counting_train_fn` (tests/support/workloads.py) with every option at its default
(`liveness_timeout` 2 s, `collective_timeout` 300 s). Each repetition is
one `fit()` in a driver subprocess (tests/support/netns_fit.py):

- silent: the node of a random rank is cut off (every packet dropped, no
  RST, as when a VM vanishes) at step 20, healed once the survivors train;
  time from the cut to the survivors' next step;
- sigkill: a random rank SIGKILLs itself at step 20; time to the
  survivors' next step;
- drain: `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION` with a 30 s
  deadline for a node at step 20; time until its workers are gone (the
  survivors' first step in the smaller world), and steps redone (0: a
  drain is a graceful leave, nothing is rolled back);
- throughput: steps/s of 4 workers on the two namespaces against 4 workers
  of one loopback node, in alternating rounds, each step an allreduce of
  `--payload` float32 (1M: 4 MB).

Needs root (network namespaces). Prints a table and writes
bench/results/node_loss.json. Reports, never asserts.

    .venv/bin/python bench/node_loss.py [--reps 5] [--rounds 3] [--payload 1000000]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests" / "support"
sys.path.insert(0, str(TESTS))

from netns_cluster import NetnsCluster, unavailable_reason  # noqa: E402
from ray_start import RayStartCluster  # noqa: E402
from results_file import write_results  # noqa: E402

FIT = str(TESTS / "netns_fit.py")


def fit(env: dict, workdir: Path, config: dict, **trainer) -> subprocess.Popen:
    ip_dir = workdir / "ips"
    ip_dir.mkdir(parents=True)
    trainer.setdefault("min_workers", 2)
    trainer.setdefault("max_workers", 4)
    spec = {"config": {**config, "ip_dir": str(ip_dir)}, "trainer": trainer}
    return subprocess.Popen(
        [sys.executable, FIT, json.dumps(spec)], env=env, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def result_of(proc: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed: {err.decode()[-3000:]}")
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"the run printed no result: {out.decode()[-2000:]} {err.decode()[-2000:]}")
    return json.loads(lines[-1])


def wait_for(path: Path, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before {what}: {proc.communicate()[1].decode()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s")
        time.sleep(0.05)


def first_step_after(result: dict, since: float, world: int) -> tuple[float, dict]:
    return next(
        (t, m)
        for t, m in zip(result["metric_times"], result["metrics"], strict=True)
        if t > since and m["world_size"] == world
    )


# the trigger waits for the whole world of 4: a run may reach step 20 before its last workers joined
BASE = {
    "signal_step": 20,
    "signal_world_size": 4,
    "min_steps": 21,
    "extra_steps": 10,
    "step_time": 0.02,
    "deadline_s": 200,
}


def silent_rep(cluster: NetnsCluster, workdir: Path, rng: random.Random) -> dict:
    signal, after = workdir / "signal", workdir / "after"
    config = {**BASE, "signal_file": str(signal), "world_signal_file": str(after), "world_signal": 2, "until_world": 2}
    proc = fit(cluster.env, workdir, config, cooldown_range=[600, 600])
    wait_for(signal, proc, 120, "step 20")
    worker = rng.choice(sorted(p.name for p in (workdir / "ips").iterdir()))
    victim = next(n for n in cluster.nodes if n.ip == (workdir / "ips" / worker).read_text())
    how = cluster.cut(victim)
    cut_at = time.time()
    try:
        wait_for(after, proc, 120, "the survivors' first step")
    finally:
        cluster.heal(victim)
    result = result_of(proc)
    t, _ = first_step_after(result, cut_at, 2)
    return {"victim": worker, "how": how, "recovery_s": t - cut_at}


def sigkill_rep(cluster: NetnsCluster, workdir: Path, rng: random.Random) -> dict:
    rank = rng.randint(0, 3)
    fault = {"rank": rank, "step": 40, "action": "sigkill", "marker": str(workdir / "fault")}
    config = {**BASE, "faults": [fault], "until_world": 3, "min_steps": 41}
    result = result_of(fit(cluster.env, workdir, config, cooldown_range=[600, 600]))
    killed = json.loads(Path(fault["marker"]).read_text())
    t, m = first_step_after(result, killed["time"], 3)
    return {"rank": rank, "recovery_s": t - killed["time"], "steps_redone": killed["step"] - (m["step"] - 1)}


def drain_rep(cluster: NetnsCluster, workdir: Path, rng: random.Random) -> dict:
    signal = workdir / "signal"
    config = {**BASE, "signal_file": str(signal), "until_world": 2}
    proc = fit(cluster.env, workdir, config, cooldown_range=[600, 600])
    wait_for(signal, proc, 120, "step 20")
    alive = cluster.node_ids()  # {ip: node id}: a node Ray declared dead after an earlier cut is not among them
    node_id = alive[rng.choice(sorted(alive))]
    drained_at = time.time()
    subprocess.run(
        [
            str(Path(sys.executable).parent / "ray"),
            "drain-node",
            f"--address={cluster.address}",
            f"--node-id={node_id}",
            "--reason=DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message=bench",
            "--deadline-remaining-seconds=30",
        ],
        env=cluster.env,
        check=True,
        capture_output=True,
    )
    result = result_of(proc)
    t, m = first_step_after(result, drained_at, 2)
    before = [x["step"] for x, ts in zip(result["metrics"], result["metric_times"], strict=True) if ts <= t]
    return {"gone_s": t - drained_at, "steps_redone": max(before[:-1]) - (m["step"] - 1)}


def throughput_round(env: dict, workdir: Path, payload: int, steps: int) -> float:
    config = {"steps": steps, "step_time": 0.0, "payload": payload, "commit_every": 10}
    result = result_of(fit(env, workdir, config, min_workers=4))
    times = result["metric_times"][steps // 5 :]  # past the start
    return (len(times) - 1) / (times[-1] - times[0])


def summary(values: list[float]) -> dict:
    return {"p50": statistics.median(values), "max": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per cluster, alternating")
    parser.add_argument("--payload", type=int, default=1_000_000, help="float32 elements allreduced per step")
    parser.add_argument("--steps", type=int, default=200, help="steps per throughput round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["silent", "sigkill", "drain", "throughput"], help="one kind of measurement")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"bench/node_loss.py needs network namespaces: {reason}")
    rng = random.Random(args.seed)
    rows: dict[str, list[dict]] = {"silent": [], "sigkill": [], "drain": []}
    rates: dict[str, list[float]] = {"netns": [], "loopback": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cluster = NetnsCluster(num_nodes=2)
        try:
            if args.only in (None, "throughput"):  # first, while both nodes are fresh (a drained one takes no worker)
                loopback = RayStartCluster(num_cpus=4)
                try:
                    for r in range(args.rounds):
                        loopback_env = {**loopback.env, "RAY_ADDRESS": loopback.address}
                        for name, env in (("netns", cluster.env), ("loopback", loopback_env)):
                            rate = throughput_round(env, work / f"tp-{name}-{r}", args.payload, args.steps)
                            rates[name].append(rate)
                            print(f"throughput round {r}, {name}: {rate:.1f} steps/s", flush=True)
                finally:
                    loopback.stop()
            for rep in range(args.reps):
                if args.only == "throughput":
                    break
                for kind, one in (("silent", silent_rep), ("sigkill", sigkill_rep), ("drain", drain_rep)):
                    if args.only not in (None, kind):
                        continue
                    while len(cluster.node_ids()) < 2:  # a node Ray declared dead after a cut: a fresh one
                        print("a worker node is gone; adding a fresh one", flush=True)
                        cluster.add_node()
                    row = one(cluster, work / f"{kind}-{rep}", rng)
                    rows[kind].append(row)
                    print(f"{kind} rep {rep}: {row}", flush=True)
        finally:
            cluster.close()
    figures: dict = {}
    for key, kind, field in (
        ("silent_recovery_s", "silent", "recovery_s"),
        ("sigkill_recovery_s", "sigkill", "recovery_s"),
        ("drain_gone_s", "drain", "gone_s"),
    ):
        if rows[kind]:
            figures[key] = summary([r[field] for r in rows[kind]])
    for kind in ("sigkill", "drain"):
        if rows[kind]:
            figures[f"{kind}_steps_redone_max"] = max(r["steps_redone"] for r in rows[kind])
    if rates["netns"]:
        figures["throughput_steps_per_s"] = {k: statistics.median(v) for k, v in rates.items()}
        figures["throughput_netns_over_loopback"] = (
            figures["throughput_steps_per_s"]["netns"] / figures["throughput_steps_per_s"]["loopback"]
        )
    print()
    print(f"{'what (defaults, 4 workers on 2 IPs)':48} {'p50':>8} {'max':>8}")
    for label, key in (
        ("silent partition -> survivors' next step (s)", "silent_recovery_s"),
        ("SIGKILL -> survivors' next step (s)", "sigkill_recovery_s"),
        ("drain notice -> departing workers gone (s)", "drain_gone_s"),
    ):
        if key in figures:
            print(f"{label:48} {figures[key]['p50']:8.2f} {figures[key]['max']:8.2f}")
    for kind in ("sigkill", "drain"):
        if f"{kind}_steps_redone_max" in figures:
            print(f"steps redone after a {kind}: max {figures[f'{kind}_steps_redone_max']}")
    tp = figures.get("throughput_steps_per_s")
    if tp:
        print(
            f"throughput ({args.payload * 4 / 1e6:g} MB allreduce per step): multi-IP {tp['netns']:.1f} steps/s, "
            f"loopback {tp['loopback']:.1f} steps/s, ratio {figures['throughput_netns_over_loopback']:.2f}"
        )
    name = "node_loss" if args.only is None else f"node_loss_{args.only}"
    write_results(name, rows, figures=figures, rates=rates, reps=args.reps, payload=args.payload)


if __name__ == "__main__":
    main()
