"""`elastic.torch.prepare_model`: torch's DistributedDataParallel on the elastic ring, in real processes.

On the session's cluster (2 nodes x 2 CPUs): a run of digits with a DDP
model at world 4 lives through a SIGKILL of rank 3 before its backward, the
replacement's scale-up back to 4 and a graceful removal of a host down to
2, and the ranks must hold bitwise-equal state after every sync and train
every sample exactly once per epoch (the soak's ledger check). It runs over
Gloo, as on several machines (there rank 1, no ring neighbour of rank 3,
must leave DDP's reducer at the driver's abandon, not at Gloo's 300 s
timeout); DDP through shared memory, which these nodes would use, goes
through a kill, a join and a leave in test_schedulers_integration.py[ddp].
A second run checks DDP's semantics in real workers: gradients averaged as
DDP averages them, `no_sync()` accumulation, options passed through, no
collective of its own for `check_host_updates()` after a step, and a user's
exception still failing the run; before it, the same workers check the
torch helpers (`broadcast_parameters`, `broadcast_optimizer_state`,
`DistributedOptimizer`'s averaging). Without Ray, in rings of processes,
the reduction is checked against plain DDP's at world 2 and 3.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from runs import fit_in_thread
from workloads import FileDiscovery, _fire_faults, torch_checks_train_fn

import ray_elastic as elastic
from ray_elastic import ElasticTrainer, TrainingFailedError
from ray_elastic.collective.shm import ENV_SWITCH as SHM_SWITCH
from ray_elastic.runtime import current

sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
import digits  # noqa: E402
from soak import check_ledger  # noqa: E402

GLOBAL_BATCH = 32  # split over the ranks, so an epoch's steps do not depend on the world size


def ledger_train_fn(config: dict) -> dict:
    """Digits with a DDP model; every rank writes what it trained (the soak's ledger) and rank 0 its progress."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if config.get("gloo"):  # as on ranks of several machines: no shared-memory sums
        os.environ[SHM_SWITCH] = "0"
    x_train, y_train, _, _ = digits.load_data(0)
    dataset = torch.utils.data.TensorDataset(x_train, y_train, torch.arange(len(y_train)))
    model = elastic.torch.prepare_model(digits.make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = elastic.torch.ElasticSampler(dataset, shuffle=True, seed=0)
    state = elastic.torch.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, step=0)
    ledger = open(os.path.join(config["ledger_dir"], f"{current().worker_id}.jsonl"), "a")  # noqa: SIM115
    sync_checks: list[bool] = []

    def write(entry: dict) -> None:
        ledger.write(json.dumps(entry) + "\n")
        ledger.flush()

    @elastic.run
    def train(state) -> dict:
        digests = elastic.allgather_object(digits.state_digest(model.module, opt))
        sync_checks.append(len(set(digests)) == 1)
        write({"sync": current().generation, "step": state.step})
        batch = GLOBAL_BATCH // elastic.size()
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler)
        while True:
            for i, (x, y, idx) in enumerate(loader):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                _fire_faults(config, state.step, phase="backward")  # the others wait in DDP's reducer for it
                loss.backward()
                opt.step()
                model(x[:1])  # a forward no backward follows (a loss logged with gradients on), then maybe a reset
                sampler.record_batch(i, batch)
                state.step += 1
                write({"gen": current().generation, "step": state.step, "epoch": state.epoch, "idx": idx.tolist()})
                _fire_faults(config, state.step)
                if elastic.rank() == 0:
                    Path(config["progress"]).write_text(json.dumps([state.step, elastic.size()]))
                time.sleep(0.01)  # stands for a bigger model's compute
                if state.step % 5 == 0:
                    state.commit()
                else:
                    state.check_host_updates()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            if elastic.broadcast_object(os.path.exists(config["stop"])):
                break
        return {
            "epochs": state.epoch,
            "n": len(y_train),
            "sync_checks": sync_checks,
            "digests": elastic.allgather_object(digits.state_digest(model.module, opt)),
            "shared": elastic.allgather_object(model.ddp.process_group._shared is not None),
        }

    return train(state)


@pytest.mark.integration
def test_ddp_through_sigkill_scale_up_and_graceful_removal_exactly_once_and_equal(cluster, no_leaks, tmp_path):
    """The session's workers share one machine: their sums would go through shared memory, but the run says Gloo
    (as ranks on several machines do), where rank 1, no ring neighbour of rank 3, leaves DDP's reducer at the
    driver's abandon. (DDP over shared memory through a kill, a join and a leave: test_schedulers_integration.py,
    its [ddp] case; a rank killed mid-backward over shared memory: test_torch_integration.py's 25M model.)"""
    hosts_file = tmp_path / "hosts.json"
    first, second = (n.node_id for n in cluster.worker_nodes_at_start)
    hosts_file.write_text(json.dumps({first: 2, second: 2}))
    progress, stop = tmp_path / "progress.json", tmp_path / "stop"
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    config = {
        "ledger_dir": str(ledger_dir),
        "progress": str(progress),
        "stop": str(stop),
        "faults": [
            {"rank": 3, "step": 12, "phase": "backward", "action": "sigkill", "marker": str(tmp_path / "killed")}
        ],
        "gloo": True,
    }
    fut = fit_in_thread(
        ElasticTrainer(
            ledger_train_fn,
            min_workers=1,
            max_workers=4,
            config=config,
            discovery=FileDiscovery(str(hosts_file)),
            cooldown_range=(1, 2),
            verbose=0,
        )
    )

    def world_at_least(step: int, size: int):
        def check():
            try:
                s, w = json.loads(progress.read_text())
            except (FileNotFoundError, ValueError):
                return False
            return s >= step and w == size

        return check

    wait_until((tmp_path / "killed").exists, 60, "rank 3 to be SIGKILLed")
    wait_until(world_at_least(13, 3), 60, "the survivors' first step at world 3")
    wait_until(world_at_least(13, 4), 90, "the replacement's scale-up back to 4 workers")
    hosts_file.write_text(json.dumps({first: 2}))
    wait_until(world_at_least(0, 2), 60, "the graceful removal back to 2 workers")
    stop.touch()
    result = fut.result(timeout=60)

    kinds = [e.kind for e in result.events]
    assert kinds[0] == "start" and "worker_failed" in kinds and "hosts_removed" in kinds
    failed = next(e for e in result.events if e.kind == "worker_failed")
    assert failed.world_size == 3 and failed.reset_duration is not None and failed.reset_duration < 10, failed
    assert max(e.world_size for e in result.events) == 4
    value = result.return_value
    assert value["shared"] == [False] * 2, f"Gloo expected, got shared memory: {value['shared']}"
    assert len(set(value["digests"])) == 1, "ranks ended with different state"
    assert len(value["sync_checks"]) >= 2 and all(value["sync_checks"]), "state differed right after a sync"
    figures = check_ledger(str(ledger_dir), value["n"], value["epochs"], max_world=4)
    assert figures["rolled_back_lines"] > 0, "the SIGKILL should have rolled some steps back"


def semantics_train_fn(config: dict) -> dict:
    """DDP's semantics in real workers; returns what each check found."""
    torch.set_num_threads(1)
    rank, size = elastic.rank(), elastic.size()
    torch.manual_seed(0)
    inner = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 3), "unused": torch.nn.Linear(4, 3)})

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body["used"](x)

    model = elastic.torch.prepare_model(Net(), find_unused_parameters=True, bucket_cap_mb=1)
    state = elastic.torch.TorchState(model=model)
    found: dict = {}

    @elastic.run
    def train(state) -> dict:
        ring = current().joined().ring
        calls = {"max_int": 0}
        max_int = ring.max_int

        def counting(value: int) -> int:
            calls["max_int"] += 1
            return max_int(value)

        ring.max_int = counting
        # y = x @ W.T + b and loss = y.sum(): each row of W's gradient is the batch's column sum of x
        xs = [torch.full((2, 4), float(rank + 1 + k)) for k in range(2)]
        weight = model.module.body["used"].weight
        with model.no_sync():
            model(xs[0]).sum().backward()
        found["local_after_no_sync"] = torch.equal(weight.grad, torch.full_like(weight, 2.0 * (rank + 1)))
        model(xs[1]).sum().backward()
        # the mean over ranks of each rank's two micro-batches: 2(r+1) + 2(r+2) averaged over r
        mean = sum(2.0 * (r + 1) + 2.0 * (r + 2) for r in range(size)) / size
        found["averaged"] = torch.allclose(weight.grad, torch.full_like(weight, mean))
        found["unused_grad"] = model.module.body["unused"].weight.grad
        found["bucket_cap"] = model.ddp.bucket_bytes_cap
        found["state_keys"] = sorted(model.state_dict())[:2]
        state.check_host_updates()
        found["extra_collectives_after_step"] = calls["max_int"]
        with model.no_sync():
            model(xs[0]).sum().backward()
        state.check_host_updates()
        found["collectives_after_no_sync"] = calls["max_int"]
        ring.max_int = max_int
        if config.get("raise"):
            raise ValueError("a bug in train_fn")
        return found

    return train(state)


def torch_helpers_then_semantics_train_fn(config: dict) -> dict:
    """The torch helpers' checks (collectives before `@elastic.run`), then DDP's semantics, in the same workers."""
    return {"torch": torch_checks_train_fn(config), **semantics_train_fn(config)}


@pytest.mark.integration
def test_ddp_semantics_and_the_torch_helpers_in_real_workers(cluster, no_leaks):
    found = ElasticTrainer(torch_helpers_then_semantics_train_fn, 2, 2, verbose=0).fit().return_value
    helpers = found["torch"]
    assert helpers["distinct_before"] == 2, "the check needs ranks that start different"
    assert helpers["distinct_after"] == 1, "broadcast_parameters + broadcast_optimizer_state made every rank equal"
    assert helpers["buckets"] > 1
    assert helpers["averaged_ok"] == [True, True], "DistributedOptimizer averaged every rank's gradients"
    assert found["local_after_no_sync"], "inside no_sync() the gradient stays local"
    assert found["averaged"], "after no_sync() the next backward averages the accumulated sums, as DDP does"
    assert found["unused_grad"] is None, "find_unused_parameters reached DDP: the unused branch got no gradient"
    assert found["bucket_cap"] == 2**20, "bucket_cap_mb reached DDP"
    assert found["state_keys"][0].startswith("module."), "state_dict() keys are DDP's"
    assert found["extra_collectives_after_step"] == 0, "check_host_updates() after a DDP step needs no collective"
    assert found["collectives_after_no_sync"] == 1, "with no reduction to ride in, it runs its own"


@pytest.mark.integration
def test_a_user_error_under_ddp_still_fails_the_run(cluster, no_leaks):
    with pytest.raises(TrainingFailedError, match="a bug in train_fn"):
        ElasticTrainer(semantics_train_fn, 2, 2, config={"raise": True}, verbose=0).fit()


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_over_the_abandonable_group_averages_as_over_gloo(tmp_path, world):
    """Without Ray: torch processes over our Gloo ring; at world 3 (no power of 2) any rounding shows.

    For DDP's plain reduction, `static_graph` and `find_unused_parameters`,
    with BatchNorm buffers DDP broadcasts at every forward. Over Gloo
    (`ours_gloo`): gradients and parameters bitwise as over Gloo's own group.
    Through shared memory (`ours`, these ranks share a machine): every rank
    bitwise equal, bitwise DDP's at world 2 (a sum of two is the same in
    any order) and within float rounding of it at world 3 (rank order, not
    ring order). Both carry the host-change notice behind each backward's
    first allreduce.
    """
    import torch.multiprocessing as mp
    from ddp_group_ranks import OPTIONS, grads_of_both

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=grads_of_both, args=(r, world, str(tmp_path), out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        found = [out.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for option in OPTIONS:
        for f in found:
            ddp, ours, over_gloo = f[option]["ddp"], f[option]["ours"], f[option]["ours_gloo"]
            assert ours["shared"], f"{option}: ranks on one machine did not sum through shared memory"
            assert not over_gloo["shared"]
            assert over_gloo["grads"] == ddp["grads"], f"{option}: DDP's average over our group differs from Gloo's"
            assert over_gloo["params"] == ddp["params"], f"{option}: parameters after 3 steps differ from Gloo's"
            if world == 2:
                assert ours["grads"] == ddp["grads"], f"{option}: a shared-memory sum of 2 differs from Gloo's"
                assert ours["params"] == ddp["params"], f"{option}: parameters after 3 steps differ from Gloo's"
            for mine, theirs in zip(ours["grad_tensors"], ddp["grad_tensors"], strict=True):
                torch.testing.assert_close(torch.from_numpy(mine), torch.from_numpy(theirs), rtol=1e-5, atol=1e-7)
            held = [int(step < world) for step in range(3)]  # rank `step` holds a notice at step `step`
            for variant in (ours, over_gloo):
                assert variant["notices"] == held, f"{option}: the ranks' notices, summed: {variant['notices']}"
        for variant in ("ours", "ours_gloo"):
            assert len({f[option][variant]["grads"] for f in found}) == 1, f"{option}/{variant}: ranks differ"
            assert len({f[option][variant]["params"] for f in found}) == 1, f"{option}/{variant}: ranks differ"
