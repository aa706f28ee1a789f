"""Checkpoints users can open, without Ray: the files, the newest N kept, torn writes.

- A `TorchState`'s checkpoint is a directory of plain files: `model.pt`,
  `optimizer.pt`, `scheduler.pt` ... that plain `torch.load` reads in a
  process where ray-elastic cannot even be imported, and that a fresh model
  and optimizer load with their own `load_state_dict`.
- `elastic.load_checkpoint` gives them back from a checkpoint directory, a
  whole `checkpoint_dir` or a `ray.train.Checkpoint`.
- `checkpoint_dir` keeps the newest `keep`; a write torn by a failure (the
  process gone before it could clean up) never becomes the latest, on local
  disk and on fsspec's `memory://`, and the next write removes it.
- A checkpoint of another model is refused, naming the keys or shapes that differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import fsspec
import pytest
import torch

import ray_elastic as elastic
from ray_elastic.checkpoint import META_FILE, CheckpointStore, load_checkpoint
from ray_elastic.checkpoint.entries import load_entries, state_entries
from ray_elastic.checkpoint.opening import ray_checkpoint
from ray_elastic.torch.sampler import ElasticSampler
from ray_elastic.trainer.preflight import check_checkpoint_dir


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))


def _trained_state(steps: int = 3) -> tuple[elastic.torch.TorchState, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6)).pow(2).sum().backward()
        opt.step()
        sched.step()
    sampler = ElasticSampler(list(range(50)), shuffle=True, seed=3)
    sampler.record_indices([1, 7, 30])
    state = elastic.torch.TorchState(model=model, optimizer=opt, scheduler=sched, sampler=sampler, epoch=2, best=0.5)
    return state, model, opt


def test_a_torch_checkpoint_is_plain_files_that_torch_load_reads_without_ray_elastic(tmp_path):
    state, model, opt = _trained_state()
    path = CheckpointStore(str(tmp_path)).write(state_entries(state), {"commit": 30, "generation": 2, "world_size": 4})
    assert sorted(os.listdir(path)) == sorted(
        ["model.pt", "optimizer.pt", "scheduler.pt", "sampler.pt", "values.json", META_FILE]
    )
    meta = json.loads(open(os.path.join(path, META_FILE)).read())
    assert (meta["commit"], meta["world_size"], meta["ray_elastic_version"]) == (30, 4, elastic.__version__)
    assert meta["written_at"] > 0
    assert json.loads(open(os.path.join(path, "values.json")).read()) == {"epoch": 2, "best": 0.5}

    # a process where `import ray_elastic` fails: plain torch.load (weights_only=True by default) reads every file
    script = f"""
import sys, torch
sys.modules["ray_elastic"] = None
model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
model.load_state_dict(torch.load({path!r} + "/model.pt"))
opt = torch.optim.AdamW(model.parameters(), lr=1.0)
opt.load_state_dict(torch.load({path!r} + "/optimizer.pt"))
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
sched.load_state_dict(torch.load({path!r} + "/scheduler.pt"))
print(model[0].weight.sum().item(), opt.param_groups[0]["lr"], opt.state[model[0].weight]["exp_avg"].sum().item(),
      sched.last_epoch)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    weight, lr, moment, last_epoch = out.stdout.split()
    assert float(weight) == pytest.approx(model[0].weight.sum().item())
    assert float(lr) == pytest.approx(opt.param_groups[0]["lr"])
    assert float(moment) == pytest.approx(opt.state[model[0].weight]["exp_avg"].sum().item())
    assert int(last_epoch) == 3


def test_the_checkpoint_holds_the_commit_not_what_trained_after_it(tmp_path):
    state, model, opt = _trained_state()
    committed = model[0].weight.detach().clone()
    entries = state_entries(state)
    opt.zero_grad()
    model(torch.randn(8, 6)).sum().backward()
    opt.step()
    assert not torch.equal(model[0].weight, committed)
    CheckpointStore(str(tmp_path)).write(entries, {"commit": 1})
    assert torch.equal(load_checkpoint(tmp_path)["model"]["0.weight"], committed)


def test_load_checkpoint_opens_a_checkpoint_a_checkpoint_dir_and_a_ray_checkpoint(tmp_path):
    state, model, _ = _trained_state()
    store = CheckpointStore(str(tmp_path / "ckpt"))
    store.write({"epoch": 0}, {"commit": 1})
    path = store.write(state_entries(state), {"commit": 2})
    for source in (path, tmp_path / "ckpt", f"file://{tmp_path}/ckpt", ray_checkpoint(path)):
        loaded = load_checkpoint(source)
        assert sorted(loaded) == ["best", "epoch", "model", "optimizer", "sampler", "scheduler"], source
        fresh = _net()
        fresh.load_state_dict(loaded["model"])
        assert torch.equal(fresh[2].bias, model[2].bias)
    with pytest.raises(elastic.checkpoint.CheckpointError, match="no complete ray-elastic checkpoint"):
        load_checkpoint(tmp_path / "empty")


def test_a_checkpoint_loads_back_into_fresh_objects_in_place(tmp_path):
    state, model, opt = _trained_state()
    store = CheckpointStore(str(tmp_path))
    store.write(state_entries(state), {"commit": 1})
    fresh_model = _net()
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=0.5)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    fresh_sampler = ElasticSampler(list(range(50)), shuffle=True, seed=3)
    fresh = elastic.torch.TorchState(
        model=fresh_model, optimizer=fresh_opt, scheduler=fresh_sched, sampler=fresh_sampler, epoch=0, best=0.0
    )
    load_entries(fresh, store.read()[0])
    assert all(
        torch.equal(a, b) for a, b in zip(fresh_model.state_dict().values(), model.state_dict().values(), strict=True)
    )
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(fresh_opt.state[fresh_model[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    assert fresh_sched.last_epoch == 3 and fresh.epoch == 2 and fresh.best == 0.5
    assert fresh_sampler.num_processed == 3


def test_a_checkpoint_of_another_model_is_refused_naming_keys_and_shapes(tmp_path):
    state, _, _ = _trained_state()
    CheckpointStore(str(tmp_path)).write(state_entries(state), {"commit": 1})
    entries = CheckpointStore(str(tmp_path)).read()[0]

    def state_for(model: torch.nn.Module) -> elastic.torch.TorchState:
        opt = torch.optim.AdamW(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        sampler = ElasticSampler(list(range(50)))
        return elastic.torch.TorchState(model=model, optimizer=opt, scheduler=sched, sampler=sampler, epoch=0, best=0)

    wider = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 2))
    with pytest.raises(ValueError, match=r"'model'.*0\.weight: \(5, 6\) in the checkpoint, \(7, 6\) here"):
        load_entries(state_for(wider), entries)
    deeper = torch.nn.Sequential(*_net(), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"'model'.*lacks keys \['3.bias', '3.weight'\]"):
        load_entries(state_for(deeper), entries)
    with pytest.raises(ValueError, match=r"holds \['best', 'epoch', 'model', 'optimizer', 'sampler', 'scheduler'\]"):
        load_entries(elastic.torch.TorchState(model=_net()), entries)


def test_checkpoint_dir_keeps_the_newest_n(tmp_path):
    store = CheckpointStore(str(tmp_path), keep=2)
    paths = [store.write({"step": i}, {"commit": i}) for i in range(1, 6)]
    assert store.checkpoints() == paths[-2:]
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in paths[-2:])
    assert store.read()[0] == {"step": 5}
    three = CheckpointStore(str(tmp_path), keep=3)
    three.write({"step": 6}, {"commit": 6})
    three.write({"step": 7}, {"commit": 7})
    assert [load_checkpoint(p)["step"] for p in three.checkpoints()] == [5, 6, 7]


class DiesMidWrite:
    """Pickling it fails, as a write does when the disk fills or the connection drops half-way."""

    def __reduce__(self):
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize("url", ["local", "memory"])
def test_a_torn_write_leaves_the_previous_checkpoint_the_latest_and_readable(tmp_path, url, monkeypatch):
    root = str(tmp_path / "ckpt") if url == "local" else "memory://torn-write-test"
    store = CheckpointStore(root)
    state, model, _ = _trained_state()
    store.write(state_entries(state), {"commit": 10})
    # the process dies mid-write: its files so far stay (no clean-up runs), the meta file never comes
    monkeypatch.setattr(CheckpointStore, "_remove", lambda self, path: None)
    torn = dict(state_entries(state), zzz_last=DiesMidWrite())
    with pytest.raises(OSError, match="No space left"):
        store.write(torn, {"commit": 20})
    monkeypatch.undo()
    fs = fsspec.core.url_to_fs(root)[0]
    (first,) = store.checkpoints()
    (torn,) = [p.rstrip("/") for p in fs.ls(store.root, detail=False) if p.rstrip("/") != first]
    assert fs.exists(f"{torn}/model.pt"), "the torn write got as far as the model"

    reopened = CheckpointStore(root)  # what a new fit() sees
    assert reopened.meta()["commit"] == 10
    assert torch.equal(reopened.read()[0]["model"]["0.weight"], model[0].weight)
    third = reopened.write({"epoch": 3}, {"commit": 30})
    left = sorted(p.rstrip("/") for p in fs.ls(store.root, detail=False))
    assert left == sorted([first, third]), "the next write removes the torn one"
    if url == "memory":
        fs.rm(store.root, recursive=True)


def test_object_state_checkpoints_are_json(tmp_path):
    state = elastic.ObjectState(step=3, w=[1.0, 2.0], name="run")
    path = CheckpointStore(str(tmp_path)).write(state_entries(state), {"commit": 1})
    assert json.loads(open(os.path.join(path, "values.json")).read()) == {"step": 3, "w": [1.0, 2.0], "name": "run"}
    fresh = elastic.ObjectState(step=0, w=[], name="")
    load_entries(fresh, load_checkpoint(path))
    assert (fresh.step, fresh.w, fresh.name) == (3, [1.0, 2.0], "run")


def test_a_checkpoint_dir_of_the_old_single_pickle_format_is_refused_before_anything_starts(tmp_path):
    """A run must not silently start over from step 0 over a checkpoint this release cannot read."""
    (tmp_path / "ray_elastic_checkpoint.pkl").write_bytes(b"a format-1 checkpoint")
    trainer = elastic.ElasticTrainer(lambda config: None, min_workers=1, max_workers=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"ray_elastic_checkpoint\.pkl.*silently start over"):
        check_checkpoint_dir(trainer.run_config, trainer.verbose)
    CheckpointStore(str(tmp_path)).write({"epoch": 3}, {"commit": 1, "world_size": 1})
    check_checkpoint_dir(trainer.run_config, trainer.verbose)  # a checkpoint of this release beside it: resumed
