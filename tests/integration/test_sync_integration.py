"""Syncs on the test cluster move state only to the ranks that lack it.

Three workers train an MLP with `TorchState` + `DistributedOptimizer(Adam)`;
rank 2 is SIGKILLed; the two survivors go on, and a newcomer joins again
once a slot is free. After every sync each rank reports what it received
(`state.last_sync`) and a digest of its model and optimizer state.
"""

from __future__ import annotations

import hashlib

import pytest
from workloads import FaultHook

import ray_elastic as elastic
from ray_elastic import ElasticTrainer

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
            hook(state.step)
            if state.step % 5 == 0:
                state.commit()
            else:
                state.check_host_updates()
        return {"syncs": syncs, "digests": elastic.allgather_object(digest())}

    return train(state)


def test_a_failure_moves_no_state_and_only_a_newcomer_receives_it(cluster, no_leaks, tmp_path):
    kill = {"rank": 2, "step": 12, "action": "sigkill", "marker": str(tmp_path / "killed")}
    result = ElasticTrainer(train_fn, 2, 3, config={"hook": FaultHook([kill])}, cooldown_range=(1, 5), verbose=0).fit()
    value = result.return_value
    syncs = value["syncs"]
    assert [s["size"] for s in syncs] == [3, 2, 3], syncs
    start, failure, growth = syncs
    assert start["receivers"] == (1, 2), "at the start every rank but 0 receives rank 0's state"
    assert failure["receivers"] == () and failure["received"] == [0, 0], "survivors of a failure receive nothing"
    assert growth["receivers"] == (2,), "only the newcomer receives"
    assert growth["received"][:2] == [0, 0] and growth["received"][2] > 0
    assert all(s["equal"] for s in syncs), f"state differed after a sync: {syncs}"
    assert len(set(value["digests"])) == 1
