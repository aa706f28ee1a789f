"""Durable checkpoints without Ray: the store and the states.

- `CheckpointStore` writes atomically and reads back what it wrote; a failed
  write leaves the previous checkpoint intact (`test_checkpoint_files.py`:
  the files themselves, the newest N kept, torn writes on local disk and on
  fsspec's `memory://`).
- `TorchState` / `ObjectState` round-trip a commit bit for bit into fresh
  objects (Adam moments and step counts included) and refuse a checkpoint of
  another model.

Resumption on real clusters is in integration/test_checkpoint_cluster.py.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from workloads import counting_train_fn

import ray_elastic as elastic
from ray_elastic import ElasticTrainer
from ray_elastic.checkpoint import META_FILE, CheckpointStore, CheckpointWriter
from ray_elastic.checkpoint.entries import load_entries, state_entries
from ray_elastic.torch.sampler import ElasticSampler

# ---- the store --------------------------------------------------------------


def test_store_round_trips_and_leaves_no_temporary_file(tmp_path):
    store = CheckpointStore(str(tmp_path / "ckpt"))
    assert store.read() is None and not store.exists()
    path = store.write({"w": [1.0, 2.0], "step": 3}, {"commit": 7})
    entries, meta = store.read()
    assert entries == {"w": [1.0, 2.0], "step": 3} and meta["commit"] == 7
    assert os.listdir(tmp_path / "ckpt") == [os.path.basename(path)]
    assert os.path.basename(path).startswith("checkpoint_r0000-g000000-c000000007-")
    assert sorted(os.listdir(path)) == sorted(["values.json", META_FILE])


class FailsToPickle:
    def __reduce__(self):
        raise OSError(28, "No space left on device")


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.write({"x": 1}, {"commit": 1})
    with pytest.raises(OSError, match="No space left"):
        store.write({"x": FailsToPickle()}, {"commit": 2})  # the write fails midway, as on a full disk
    assert store.read()[0] == {"x": 1}
    assert len(os.listdir(tmp_path)) == 1, "the failed write left nothing behind"


def test_fsspec_urls_work(tmp_path):
    store = CheckpointStore(f"file://{tmp_path}/remote")
    store.write({"w": [1.5]}, {"commit": 1})
    assert CheckpointStore(str(tmp_path / "remote")).read()[0] == {"w": [1.5]}


class FlakyStore(CheckpointStore):
    """A real local store whose first `failures` writes fail, as a throttled bucket's would."""

    def __init__(self, url: str, failures: int) -> None:
        super().__init__(url)
        self.failures = failures

    def write(self, entries, meta, fence=None) -> str:
        if self.failures:
            self.failures -= 1
            raise OSError("503 Slow Down")
        return super().write(entries, meta, fence=fence)


def test_a_write_that_fails_once_is_retried_and_lands(tmp_path):
    """Found trying it: one failed write failed the run at the next commit."""
    store = FlakyStore(str(tmp_path / "ckpt"), failures=1)
    writer = CheckpointWriter(store, attempts=3, backoff_s=0.01)
    writer.submit({"x": 1}, {"commit": 1}, timeout=10)
    assert writer.flush(timeout=10) is None
    assert writer.written == 1 and CheckpointStore(str(tmp_path / "ckpt")).read()[0] == {"x": 1}


def test_a_write_that_keeps_failing_is_skipped_training_goes_on_and_the_end_says_so(tmp_path):
    store = FlakyStore(str(tmp_path / "ckpt"), failures=3)
    writer = CheckpointWriter(store, attempts=3, backoff_s=0.01)
    writer.submit({"x": 1}, {"commit": 1}, timeout=10)
    writer.submit({"x": 2}, {"commit": 2}, timeout=10)  # no raise: the next commit goes on
    assert writer.flush(timeout=10) is None  # the second write landed: the newest checkpoint is durable
    assert store.read()[0] == {"x": 2}
    store.failures = 3
    writer.submit({"x": 3}, {"commit": 3}, timeout=10)
    note = writer.flush(timeout=10)
    assert (
        note.startswith("writing the checkpoint {'commit': 3} to") and "failed 3 times: OSError: 503 Slow Down" in note
    )
    assert store.read()[0] == {"x": 2}, "the previous checkpoint stays the latest"


def test_an_unwritable_directory_is_reported_at_flush_not_raised(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the directory should be")
    writer = CheckpointWriter(CheckpointStore(str(blocker / "sub")), attempts=2, backoff_s=0.01)
    writer.submit({"x": 1}, {"commit": 1}, timeout=10)
    assert "failed 2 times" in writer.flush(timeout=10)


# ---- states -----------------------------------------------------------------


def _model_and_adam(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 6)).pow(2).sum().backward()
        opt.step()
    return model, opt


def _flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    for p in model.parameters():
        out += [v.clone() for v in opt.state[p].values()]
    return out


def test_torch_state_round_trips_a_commit_into_fresh_objects(tmp_path):
    model, opt = _model_and_adam(0)
    dataset = list(range(50))
    sampler = ElasticSampler(dataset, shuffle=True, seed=3)
    sampler.record_indices([1, 7, 30])
    state = elastic.torch.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=2, note="x")
    committed = _flat(model, opt)
    store = CheckpointStore(str(tmp_path))
    store.write(state_entries(state), {"commit": 1})
    # training goes on after the commit: the checkpoint must still hold the commit
    opt.zero_grad()
    model(torch.randn(8, 6)).sum().backward()
    opt.step()

    fresh_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.5)  # no moments yet, another lr
    fresh_sampler = ElasticSampler(dataset, shuffle=True, seed=3)
    fresh = elastic.torch.TorchState(model=fresh_model, optimizer=fresh_opt, sampler=fresh_sampler, epoch=0, note="")
    load_entries(fresh, store.read()[0])
    loaded = _flat(fresh_model, fresh_opt)
    assert len(loaded) == len(committed)
    assert all(torch.equal(a, b) for a, b in zip(loaded, committed, strict=True))
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    assert fresh.epoch == 2 and fresh.note == "x"
    assert fresh_sampler.state_dict()["bitmap"].tobytes() == sampler.state_dict()["bitmap"].tobytes()
    assert fresh_sampler.num_processed == 3


def test_checkpoint_of_another_model_is_refused():
    model, opt = _model_and_adam(0)
    payload = elastic.torch.TorchState(model=model, optimizer=opt).checkpoint_payload()
    other = torch.nn.Linear(6, 2)
    state = elastic.torch.TorchState(model=other, optimizer=torch.optim.Adam(other.parameters()))
    with pytest.raises(ValueError, match="tensor shapes"):
        state.load_checkpoint(payload)
    with pytest.raises(ValueError, match="holds"):
        elastic.torch.TorchState(model=other).load_checkpoint(payload)


def test_object_state_round_trips_the_commit_not_the_live_values():
    state = elastic.ObjectState(step=3, w=[1.0])
    payload = state.checkpoint_payload()
    state.step = 9
    fresh = elastic.ObjectState(step=0, w=[])
    fresh.load_checkpoint(payload)
    assert (fresh.step, fresh.w) == (3, [1.0])


def test_checkpoint_of_another_experiment_is_refused_naming_what_differs():
    payload = elastic.ObjectState(step=3, w=np.zeros((2, 3), np.float32), best=None).checkpoint_payload()
    with pytest.raises(ValueError, match=r"holds \['best', 'step', 'w'\], this state holds \['epoch', 'step', 'w'\]"):
        elastic.ObjectState(step=0, w=np.zeros((2, 3), np.float32), epoch=0).load_checkpoint(payload)
    with pytest.raises(ValueError, match=r"w: this state holds shape \(3, 2\) float32, the checkpoint shape \(2, 3\)"):
        elastic.ObjectState(step=0, w=np.zeros((3, 2), np.float32), best=None).load_checkpoint(payload)
    with pytest.raises(ValueError, match="step: this state holds a str, the checkpoint a int"):
        elastic.ObjectState(step="a", w=np.zeros((2, 3), np.float32), best=None).load_checkpoint(payload)
    # what a later commit of the same experiment may legitimately hold still loads
    fresh = elastic.ObjectState(step=0.0, w=np.ones((2, 3), np.float32), best=1.5)
    fresh.load_checkpoint(payload)
    assert fresh.step == 3 and fresh.best is None and not fresh.w.any()


def test_torch_state_names_the_attribute_a_checkpoint_does_not_fit():
    model, opt = _model_and_adam(0)
    sampler = ElasticSampler(list(range(50)))
    payload = elastic.torch.TorchState(model=model, sampler=sampler, tag="a").checkpoint_payload()
    with pytest.raises(ValueError, match="'sampler': the checkpoint's sampler covers 50 samples, this one 40"):
        elastic.torch.TorchState(model=model, sampler=ElasticSampler(list(range(40))), tag="a").load_checkpoint(payload)
    with pytest.raises(ValueError, match="'tag': .*holds a int, the checkpoint a str"):
        elastic.torch.TorchState(model=model, sampler=ElasticSampler(list(range(50))), tag=1).load_checkpoint(payload)


def test_bad_checkpoint_options_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 1"):
        ElasticTrainer(counting_train_fn, 1, 1, checkpoint_dir="/tmp/x", checkpoint_every=0)
    with pytest.raises(ValueError, match="checkpoint_keep must be an integer >= 1, got 0"):
        ElasticTrainer(counting_train_fn, 1, 1, checkpoint_dir="/tmp/x", checkpoint_keep=0)
    with pytest.raises(ValueError, match="fsspec cannot open it"):
        ElasticTrainer(counting_train_fn, 1, 1, checkpoint_dir="nosuchprotocol://bucket/x")
    with pytest.raises(ValueError, match="checkpoint_dir must be a path"):
        ElasticTrainer(counting_train_fn, 1, 1, checkpoint_dir=42)
