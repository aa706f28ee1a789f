"""Chaos soak: digits under a seeded random schedule of kills, hangs and node changes.

Every rank appends to a ledger (one JSON line per step: generation, step,
epoch, the sample indices it trained) and, right after each sync, the step
it resumed from. A failure rolls the state back to the last commit, so the
steps after it never counted: for each sync (generation g, step S), ledger
lines of older generations with a step after S are dropped. What is left is
what the final model learned from, and every epoch of it must cover every
sample exactly once, apart from the padding that evens out a split.

`run_soak()` is used by tests/integration/test_soak.py (short, in `make test`) and by
`make soak` (`python tests/support/soak.py --events 30`, its own 4-node cluster).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, for its conftest's cluster helpers under `make soak` too
sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))

import digits  # noqa: E402
from workloads import _fire_faults  # noqa: E402

import ray_elastic as elastic  # noqa: E402
from ray_elastic.runtime import current  # noqa: E402

GLOBAL_BATCH = 64  # split over the ranks, so steps per epoch do not depend on the world size


def ledger_writer(ledger_dir: str):
    """This worker's ledger: a function appending one JSON line (flushed: a SIGKILL loses nothing written)."""
    ledger = open(os.path.join(ledger_dir, f"{current().worker_id}.jsonl"), "a")  # noqa: SIM115

    def write(entry: dict) -> None:
        ledger.write(json.dumps(entry) + "\n")
        ledger.flush()

    return write


def soak_train_fn(config: dict) -> dict:
    torch.set_num_threads(1)
    seed = config["seed"]
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = digits.load_data(seed)
    dataset = TensorDataset(x_train, y_train, torch.arange(len(y_train)))
    model = digits.make_model()
    base = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    opt = elastic.torch.DistributedOptimizer(base)
    sampler = elastic.torch.ElasticSampler(dataset, shuffle=True, seed=seed)
    state = elastic.torch.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)
    write = ledger_writer(config["ledger_dir"])

    @elastic.run
    def train(state) -> dict:
        # a fixed global batch, split over however many ranks there are now: the chaos run then
        # takes the same optimisation steps as the fault-free run it is compared with
        batch = max(1, GLOBAL_BATCH // elastic.size())
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
        # a resumed fit() (config "attempt") starts counting generations again: keep them ordered
        gen = config.get("attempt", 0) * 1000 + current().generation
        write({"sync": gen, "step": state.step})
        while state.epoch < config["epochs"]:
            for i, (x, y, idx) in enumerate(loader):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                sampler.record_batch(i, batch)
                state.step += 1
                write({"gen": gen, "step": state.step, "epoch": state.epoch, "idx": idx.tolist()})
                _fire_faults(config, state.step)
                elastic.report({"step": state.step, "epoch": state.epoch, "world_size": elastic.size()})
                time.sleep(config.get("step_time", 0.01))  # stands for a bigger model's compute
                if state.step % 5 == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
        with torch.no_grad():
            train_loss = float(torch.nn.functional.cross_entropy(model(x_train), y_train))
            test_loss = float(torch.nn.functional.cross_entropy(model(x_test), y_test))
        return {
            "epochs": state.epoch,
            "final_loss": test_loss,  # held-out: what a user judges the run by
            "train_loss": train_loss,
            "digests": elastic.allgather_object(digits.state_digest(model, base)),
            "n": len(y_train),
        }

    return train(state)


def check_ledger(ledger_dir: str, n: int, epochs: int, max_world: int) -> dict:
    """Exactly-once per epoch over what the final model learned from; returns the figures."""
    lines = [json.loads(line) for f in Path(ledger_dir).glob("*.jsonl") for line in f.read_text().splitlines()]
    syncs = {(e["sync"], e["step"]) for e in lines if "sync" in e}
    steps = [e for e in lines if "idx" in e]
    kept = [e for e in steps if not any(e["gen"] < g and e["step"] > s for g, s in syncs)]
    problems, duplicates = [], 0
    for epoch in range(epochs):
        counts = collections.Counter(i for e in kept if e["epoch"] == epoch for i in e["idx"])
        missing = n - len(counts)
        extra = sum(counts.values()) - len(counts)
        duplicates += extra
        if missing or extra > max_world - 1:
            problems.append(f"epoch {epoch}: {missing} samples never trained, {extra} trained twice")
    assert not problems, "exactly-once violated: " + "; ".join(problems[:5])
    return {
        "generations": len({g for g, _ in syncs}),
        "samples_checked": sum(len(e["idx"]) for e in kept),
        "ledger_lines": len(steps),
        "rolled_back_lines": len(steps) - len(kept),
        "padding_duplicates": duplicates,
    }


@dataclass
class Chaos:
    """The seeded schedule, carried out against a running fit()."""

    cluster: object
    seed: int
    events: int
    ledger_dir: str
    gap_lines: int = 40
    done: list[dict] = field(default_factory=list)
    added: list = field(default_factory=list)

    def _progress(self) -> int:
        return sum(len(f.read_text().splitlines()) for f in Path(self.ledger_dir).glob("*.jsonl"))

    def _workers(self) -> list[tuple[str, int]]:
        from conftest import actor_pid, run_namespaces_alive

        out = []
        for entry in run_namespaces_alive():
            if entry["name"].startswith("w"):
                try:
                    out.append((entry["name"], actor_pid(entry["name"], entry["namespace"])))
                except Exception:  # noqa: BLE001 - stopped, dying or gone: not a target
                    continue
        return out

    def run(self, fit_done: threading.Event) -> None:
        rng = random.Random(self.seed)
        last = self._progress()
        while len(self.done) < self.events and not fit_done.is_set():
            deadline = time.monotonic() + 60
            while self._progress() < last + self.gap_lines and not fit_done.is_set():
                if time.monotonic() > deadline:
                    raise AssertionError("training made no progress for 60 s during the soak")
                time.sleep(0.1)
            if fit_done.is_set():
                break
            workers = self._workers()
            actions = []
            if len(workers) >= 3:
                actions += ["kill", "kill", "hang"]
            if len(self.added) < 2:
                actions.append("add_node")
            if self.added and len(workers) >= 4:
                actions.append("remove_node")
            if not actions:
                last = self._progress()
                continue
            action = rng.choice(actions)
            event = {"time": time.time(), "action": action}
            if action in ("kill", "hang"):
                name, pid = rng.choice(workers)
                os.kill(pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
                event["worker"] = name
            elif action == "add_node":
                self.added.append(self.cluster.add_node(num_cpus=2))
            else:
                node = self.added.pop(rng.randrange(len(self.added)))
                event["node"] = node.node_id[:8]
                self.cluster.remove_node(node)
            self.done.append(event)
            last = self._progress()

    def cleanup(self) -> None:
        for node in self.added:
            self.cluster.remove_node(node)
        self.added.clear()


def run_soak(cluster: object, events: int, seed: int = 0, epochs: int = 40, spares: int = 0) -> dict:
    """One chaos run and one fault-free run with the same seed; returns the figures, asserts the promises.

    `spares`: hot spares; chaos kills and hangs them as it does members (any worker actor it finds). With
    spares the world is held to 4, so that the cluster's 6 slots leave room for them.
    """
    from conftest import wait_until

    ledger_dir = tempfile.mkdtemp(prefix="ray-elastic-soak-")
    config = {"seed": seed, "lr": 0.05, "epochs": epochs, "ledger_dir": ledger_dir}
    # liveness_timeout at its default: the soak measures its false positives on a loaded 2-core machine
    trainer = elastic.ElasticTrainer(
        soak_train_fn, 2, 4 if spares else 8, config=config, cooldown_range=(1, 4), verbose=0, spares=spares
    )
    box: dict = {}
    fit_done = threading.Event()

    def fit() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e
        finally:
            fit_done.set()

    runner = threading.Thread(target=fit, daemon=True)
    runner.start()
    chaos = Chaos(cluster, seed, events, ledger_dir)
    try:
        chaos.run(fit_done)
        wait_until(fit_done.is_set, 300, "the soak run to finish")
    finally:
        chaos.cleanup()
    if "error" in box:
        raise box["error"]
    result = box["result"]
    value = result.return_value
    assert len(chaos.done) >= events, f"training ended after {len(chaos.done)} of {events} chaos events"
    assert value["epochs"] == epochs
    assert len(set(value["digests"])) == 1, "ranks ended with different parameters"
    max_world = max(m["world_size"] for m in result.metrics_history)
    figures = check_ledger(ledger_dir, value["n"], epochs, max_world)
    failed = [e for e in result.events if e.kind in ("worker_failed", "newcomer_failed")]
    for event in chaos.done:
        if "worker" in event:
            assert any(f"worker {event['worker']} " in e.detail for e in failed), f"no event for {event}"
    # a worker declared failed that chaos did not touch and whose node was not removed: a false positive
    # (a worker on a removed node can miss its pings, and be killed for it, before Ray reports the node gone)
    touched = {f"worker {event['worker']} " for event in chaos.done if "worker" in event}
    touched |= {f" on node {event['node']} " for event in chaos.done if "node" in event}
    unexplained = [
        e.detail for e in failed if not any(t in e.detail for t in touched) and "its node is gone" not in e.detail
    ]
    assert not unexplained, f"healthy workers were declared failed: {unexplained}"
    recoveries = [e.reset_duration for e in failed if e.reset_duration is not None]
    clean = reference_run(config)
    figures.update(
        events=len(chaos.done),
        actions=dict(collections.Counter(e["action"] for e in chaos.done)),
        worker_failed_events=len(failed),
        false_positive_failures=len(unexplained),
        worst_recovery_s=max(recoveries) if recoveries else None,
        final_loss=value["final_loss"],
        clean_final_loss=clean["final_loss"],
        train_loss=value["train_loss"],
        clean_train_loss=clean["train_loss"],
        resets=result.resets,
        spares=spares,
        spares_promoted=result.spares_promoted,
    )
    return figures


def reference_run(config: dict) -> dict:
    """The fault-free run, in this process: the same seed, initial model, epochs, sample order and global batch.

    The soak's global batch is fixed (64, split over the ranks, gradients
    averaged), so every world size takes the same optimisation steps as one
    process taking the whole batch; only floating-point summation order
    differs. No Ray: seconds instead of a second cluster run.
    """
    torch.set_num_threads(1)
    seed = config["seed"]
    torch.manual_seed(seed)
    x_train, y_train, x_test, y_test = digits.load_data(seed)
    model = digits.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    for epoch in range(config["epochs"]):
        order = torch.from_numpy(np.random.default_rng(seed + epoch).permutation(len(y_train)))  # the sampler's
        for start in range(0, len(order), GLOBAL_BATCH):
            idx = order[start : start + GLOBAL_BATCH]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
    with torch.no_grad():
        return {
            "final_loss": float(torch.nn.functional.cross_entropy(model(x_test), y_test)),
            "train_loss": float(torch.nn.functional.cross_entropy(model(x_train), y_train)),
        }


def loss_gap(figures: dict) -> float:
    """Relative distance of the chaos run's final test loss from the fault-free run's."""
    return abs(figures["final_loss"] - figures["clean_final_loss"]) / figures["clean_final_loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description="the long chaos soak")
    parser.add_argument("--events", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--spares", type=int, default=0, help="hot spares (chaos kills and hangs them too)")
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(3):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    cluster.wait_for_nodes()
    try:
        figures = run_soak(cluster, args.events, args.seed, args.epochs, args.spares)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(figures, indent=2))
    print(
        f"{figures['events']} events, worst recovery {figures['worst_recovery_s']:.3f} s, "
        f"{figures['samples_checked']} samples checked exactly once, ranks bitwise equal"
    )
    gap = loss_gap(figures)
    if gap > 0.05:
        sys.exit(
            f"final test loss {figures['final_loss']:.4f} is {gap:.1%} from the fault-free run's "
            f"{figures['clean_final_loss']:.4f}: more than 5%"
        )
    print(f"final test loss within {gap:.1%} of a fault-free run: soak passed")


if __name__ == "__main__":
    main()
