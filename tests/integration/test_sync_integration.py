"""A SIGKILL on the test cluster, end to end with torch: recovery, takeover, reset callbacks and syncs.

Three workers train an MLP with `TorchState` + `DistributedOptimizer(Adam)`;
rank 0 is SIGKILLed; the two survivors go on from the last commit with the
oldest of them as rank 0, and a newcomer joins again once a slot is free.
After every sync each rank reports what it received (`state.last_sync`) and
a digest of its model and optimizer state; rank 0 reports each step with the
world size and its worker id; a reset callback records the world size it saw.

This one run covers what four did: a SIGKILL recovers from the last commit
and refills the slot, rank 0's death hands rank 0 to the oldest survivor,
reset callbacks see the new world, and syncs move state only to a newcomer.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from runs import sizes
from workloads import FaultHook

import ray_elastic as elastic
from ray_elastic import ElasticTrainer
from ray_elastic.runtime import current

pytestmark = pytest.mark.integration


def train_fn(config: dict) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = elastic.torch.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    state = elastic.torch.TorchState(model=model, optimizer=opt, step=0, sizes=[], entered_at=0)
    hook = config["hook"]
    syncs: list[dict] = []
    reset_sizes: list[int] = []  # what this worker's reset callbacks saw
    state.register_reset_callbacks([lambda: reset_sizes.append(elastic.size())])

    def digest() -> str:
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().numpy().tobytes())
            for _, v in sorted(opt.state[p].items()):
                h.update(v.numpy().tobytes())
        return h.hexdigest()

    @elastic.run
    def train(state) -> dict:
        report = state.last_sync
        seen = elastic.allgather_object((report.received_bytes, digest()))
        syncs.append(
            {
                "size": elastic.size(),
                "receivers": report.receivers,
                "received": [r for r, _ in seen],
                "equal": len({d for _, d in seen}) == 1,
            }
        )
        state.sizes = [*state.sizes, elastic.size()]
        state.entered_at = state.step
        g = torch.Generator().manual_seed(elastic.rank())
        # the same condition on every rank: back at 3 after the failure, and a few steps there
        while not (state.sizes[-2:] == [2, 3] and state.step >= state.entered_at + 5) and state.step < 3000:
            opt.zero_grad()
            model(torch.randn(8, 32, generator=g)).square().mean().backward()
            opt.step()
            state.step += 1
            elastic.report({"step": state.step, "world_size": elastic.size(), "rank0": current().worker_id})
            hook(state.step)
            if state.step % 5 == 0:
                state.commit()
            else:
                state.check_host_updates()
        return {"syncs": syncs, "digests": elastic.allgather_object(digest()), "reset_sizes": reset_sizes}

    return train(state)


def test_rank0_sigkilled_the_oldest_survivor_resumes_from_the_commit_and_only_a_newcomer_receives_state(
    cluster, no_leaks, tmp_path
):
    marker = tmp_path / "killed"
    # rank 0's reports at world 3 reach the driver before it dies: the reports of its last 0.25 s would be lost
    kill = {"rank": 0, "step": 42, "action": "sigkill", "marker": str(marker), "shipped": True}
    result = ElasticTrainer(train_fn, 2, 3, config={"hook": FaultHook([kill])}, cooldown_range=(1, 5), verbose=0).fit()
    assert sizes(result) == [3, 2, 3], "the slot of the killed worker was refilled"

    victim = json.loads(marker.read_text())
    history = list(zip(result.metric_times, result.metrics_history, strict=False))
    before = {m["rank0"] for t, m in history if t <= victim["time"]}
    assert victim["worker"] == "w1" and before == {"w1"}, f"the victim was rank 0 at world 3: {victim}, {before}"
    recovered_at, first = next((t, m) for t, m in history if t > victim["time"] and m["world_size"] == 2)
    assert first["rank0"] == "w2", "the oldest survivor becomes rank 0"
    # the kill came at step 42, before its commit: survivors resume from the commit at step 40
    assert first["step"] == 41, "state rolls back to the last commit (step 40)"
    print(f"SIGKILL -> survivors' next completed step: {recovered_at - victim['time']:.3f} s")
    kinds = [e.kind for e in result.events]
    assert kinds[:2] == ["start", "worker_failed"] and "hosts_added" in kinds, kinds
    assert all(e.reset_duration is not None for e in result.events)

    value = result.return_value
    # rank 0 (w2) survived the failure: its callbacks ran after each new ring existed, of 2 and then of 3
    assert value["reset_sizes"] == [2, 3]
    syncs = value["syncs"]
    assert [s["size"] for s in syncs] == [3, 2, 3], syncs
    start, failure, growth = syncs
    assert start["receivers"] == (1, 2), "at the start every rank but 0 receives rank 0's state"
    assert failure["receivers"] == () and failure["received"] == [0, 0], "survivors of a failure receive nothing"
    assert growth["receivers"] == (2,), "only the newcomer receives"
    assert growth["received"][:2] == [0, 0] and growth["received"][2] > 0
    assert all(s["equal"] for s in syncs), f"state differed after a sync: {syncs}"
    assert len(value["digests"]) == 3 and len(set(value["digests"])) == 1
