"""`ray_elastic.train` without a Ray cluster: configs mapped and refused, the prepared loader's passes, the patching.

Refusals happen in `TorchTrainer(...)` itself, before `fit()` could spawn
anything. The sampler's passes are simulated with ranks in one process, as
tests/unit/test_prepare_data_loader.py does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("ray.train")

import pyarrow.fs  # noqa: E402
import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402

import ray_elastic.train as train  # noqa: E402
from ray_elastic.torch import prepare_data_loader  # noqa: E402
from ray_elastic.torch.state import TorchState  # noqa: E402
from ray_elastic.train import session as train_session  # noqa: E402
from ray_elastic.train.torch import TorchConfig, TorchTrainer  # noqa: E402


def _loop(config):
    return config


# ---- configs: mapped onto ElasticTrainer's options, or refused by name --------------------------------


def test_num_workers_int_is_a_fixed_world_and_a_tuple_an_elastic_one(tmp_path):
    fixed = TorchTrainer(_loop, scaling_config=train.ScalingConfig(num_workers=3))
    assert (fixed.trainer.run_config.min_workers, fixed.trainer.run_config.max_workers) == (3, 3)
    ranged = TorchTrainer(
        _loop,
        scaling_config=train.ScalingConfig(num_workers=(2, 5), use_gpu=True),
        run_config=train.RunConfig(
            name="exp",
            storage_path=str(tmp_path),
            checkpoint_config=train.CheckpointConfig(num_to_keep=4),
            failure_config=train.FailureConfig(max_failures=-1),
        ),
        torch_config=TorchConfig(backend="gloo"),
    )
    cfg = ranged.trainer.run_config
    assert (cfg.min_workers, cfg.max_workers) == (2, 5)
    assert dict(cfg.resources_per_worker) == {"CPU": 1.0, "GPU": 1.0}
    assert cfg.checkpoint_keep == 4 and cfg.checkpoint_every == 1
    assert str(cfg.checkpoint_dir).startswith(str(tmp_path / "exp"))
    assert cfg.max_failures > 10**6, "Ray's max_failures=-1 is unlimited"
    assert cfg.backend == "gloo"
    assert ranged.path == str(tmp_path / "exp")


def test_hot_spares_ride_on_our_scaling_config_and_rays_own_class_refuses_the_keyword():
    ours = train.ScalingConfig(num_workers=(2, 4), spares=1)
    assert isinstance(ours, ray.train.ScalingConfig), "Ray's code and the user's checks still see Ray's class"
    assert TorchTrainer(_loop, scaling_config=ours).trainer.run_config.spares == 1
    assert TorchTrainer(_loop, scaling_config=ray.train.ScalingConfig(num_workers=2)).trainer.run_config.spares == 0
    with pytest.raises(TypeError, match="spares"):
        ray.train.ScalingConfig(num_workers=2, spares=1)
    with pytest.raises(ValueError, match=r"^ScalingConfig\(placement_strategy='SPREAD'\) is not supported"):
        TorchTrainer(_loop, scaling_config=train.ScalingConfig(num_workers=2, placement_strategy="SPREAD"))
    with pytest.raises(ValueError, match="spares"):
        TorchTrainer(_loop, scaling_config=train.ScalingConfig(num_workers=2, spares=-1))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"scaling_config": ray.train.ScalingConfig(num_workers=2, label_selector={"a": "b"})}, "label_selector"),
        ({"scaling_config": ray.train.ScalingConfig(num_workers=1, use_tpu=True)}, "use_tpu"),
        ({"scaling_config": ray.train.ScalingConfig(num_workers=2, placement_strategy="SPREAD")}, "placement_strategy"),
        ({"run_config": ray.train.RunConfig(callbacks=[ray.train.UserCallback()])}, "callbacks"),
        ({"run_config": ray.train.RunConfig(storage_filesystem=pyarrow.fs.LocalFileSystem())}, "storage_filesystem"),
        (
            {
                "run_config": ray.train.RunConfig(
                    checkpoint_config=ray.train.CheckpointConfig(checkpoint_score_attribute="loss")
                )
            },
            "checkpoint_score_attribute",
        ),
        (
            {"run_config": ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_preemption_failures=3))},
            "max_preemption_failures",
        ),
        ({"torch_config": ray.train.torch.TorchConfig(init_method="tcp")}, "init_method"),
        ({"torch_config": ray.train.torch.TorchConfig(backend="mpi")}, "backend"),
        ({"validation_config": object()}, "validation_config"),
        ({"dataset_config": object()}, "dataset_config"),
        ({"metadata": {"a": 1}}, "metadata"),
    ],
)
def test_what_has_no_elastic_counterpart_is_refused_naming_the_field(kwargs, field, monkeypatch):
    import ray_elastic

    def spawned(*a, **k):
        raise AssertionError("nothing may be built before the refusal")

    monkeypatch.setattr(ray_elastic, "ElasticTrainer", spawned)
    with pytest.raises(ValueError, match=field):
        TorchTrainer(_loop, **kwargs)


def _loop_reading_shards():
    for _ in ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=8):
        pass
    ray.train.get_dataset_shard("valid")


def test_a_shard_name_the_datasets_lack_is_refused_through_ray_trains_calls(monkeypatch):
    """The loop asks for "valid" by Ray Train's fully qualified call; only "train" was given: refused at once."""
    import ray.data

    from ray_elastic import ElasticTrainer

    def spawned(*a, **k):
        raise AssertionError("nothing may start before the refusal")

    monkeypatch.setattr(ElasticTrainer, "fit", spawned)

    class Shardless(ray.data.Dataset):
        """A Dataset to the type check, made without Ray."""

        def __init__(self) -> None:
            pass

        def __del__(self) -> None:
            pass

    with pytest.raises(
        ValueError, match=r"train_loop_per_worker asks get_dataset_shard for \['valid'\], but TorchTrainer"
    ):
        TorchTrainer(_loop_reading_shards, datasets={"train": Shardless()})


def test_an_unknown_keyword_is_a_type_error_as_in_ray():
    with pytest.raises(TypeError, match="nonsense"):
        TorchTrainer(_loop, nonsense=1)


def test_an_unknown_parallel_strategy_is_refused(monkeypatch):
    monkeypatch.setattr(train_session, "_SESSION", object())
    with pytest.raises(ValueError, match="parallel_strategy='deepspeed'"):
        ray_elastic_train_torch().prepare_model(torch.nn.Linear(2, 2), parallel_strategy="deepspeed")


def ray_elastic_train_torch():
    import ray_elastic.train.torch as t

    return t


def test_the_calls_refuse_to_run_outside_a_worker_loop():
    with pytest.raises(RuntimeError, match="train_loop_per_worker"):
        train.report({"loss": 1.0})
    with pytest.raises(RuntimeError, match="train_loop_per_worker"):
        train.get_checkpoint()


# ---- the loop's interrupts and the fully qualified calls -----------------------------------------------


def test_an_interrupt_crosses_the_users_except_exception():
    def users_loop():
        try:
            raise train.LoopInterrupt(ray_elastic_exceptions().HorovodInternalError("peer died"))
        except Exception:  # noqa: BLE001 - what user code does
            return "swallowed"

    with pytest.raises(train.LoopInterrupt):
        users_loop()


def ray_elastic_exceptions():
    import ray_elastic

    return ray_elastic


def test_ray_train_calls_reach_the_elastic_ones_only_while_the_loop_runs():
    before = ray.train.report, ray.train.get_checkpoint, ray.train.torch.prepare_model
    with train_session._ray_train_calls_elastic():
        assert ray.train.report is train.report
        assert ray.train.get_checkpoint is train.get_checkpoint
        assert ray.train.get_context is train.get_context
        assert ray.train.torch.prepare_model is ray_elastic_train_torch().prepare_model
        assert ray.train.torch.prepare_data_loader is ray_elastic_train_torch().prepare_data_loader
    assert (ray.train.report, ray.train.get_checkpoint, ray.train.torch.prepare_model) == before


def test_checkpoint_files_round_trip_through_memory(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.pt").write_bytes(b"weights")
    (src / "sub" / "meta.json").write_bytes(b"{}")
    files = train_session.read_directory(train.Checkpoint.from_directory(str(src)))
    assert files == {"model.pt": b"weights", "sub/meta.json": b"{}"}
    train_session.write_files(files, str(tmp_path / "dst"))
    assert (tmp_path / "dst" / "sub" / "meta.json").read_bytes() == b"{}"


# ---- the prepared loader's passes (the bug Ray Train's examples hit) ----------------------------------

N, BS = 10, 2


def _loader(rank=0, size=2):
    loader = prepare_data_loader(DataLoader(TensorDataset(torch.arange(N)), batch_size=BS), move_to_device=False)
    loader.sampler.set_world(rank, size)
    return loader


def test_a_completed_pass_leaves_the_next_one_whole_like_distributed_sampler():
    loader = _loader()
    first = [x.tolist() for (x,) in loader]
    second = [x.tolist() for (x,) in loader]
    assert len(loader) == len(first) == 3
    assert second == first, "a second pass in the same epoch (an eval loader) must be whole"
    loss_sum = sum(len(b) for b in second)
    assert loss_sum / len(loader) > 0  # Ray Train's examples divide by len(test_loader)


def test_a_pass_cut_by_a_rollback_still_resumes_where_it_was():
    loaders = [_loader(r) for r in range(2)]
    states = [TorchState(loader=lo) for lo in loaders]
    its = [iter(lo) for lo in loaders]
    seen = [next(it)[0].tolist() for it in its]  # batch 0 on both ranks
    for s in states:
        s.save()  # committed after batch 0's step
    for it in its:
        next(it)  # batch 1, then a failure
    for s in states:
        s.restore()
    rest = [b[0].tolist() for lo in loaders for b in lo]
    trained = sorted(i for batch in seen + rest for i in batch)
    assert trained == list(range(N)), "the rolled-back pass resumes: each sample once"
    again = [b[0].tolist() for lo in loaders for b in lo]  # that pass completed: the next is whole
    assert sorted(i for b in again for i in b) == list(range(N))


def test_a_commit_after_a_completed_pass_keeps_the_next_one_whole():
    loader = _loader(0, 1)
    state = TorchState(loader=loader)
    list(loader)
    state.save()  # Ray Train's report(checkpoint) after the epoch
    state.restore()
    assert len(loader) == N // BS
    assert len(list(loader)) == N // BS


# ---- positions by preparation order, and a shard's passes ----------------------------------------------


def test_a_re_entered_loop_gets_each_prepared_loader_back_where_the_last_report_left_it(monkeypatch):
    session = train_session.Session("exp", None)
    monkeypatch.setattr(train_session, "_SESSION", session)
    train_loader = _loader(0, 1)
    it = iter(train_loader)
    next(it), next(it)  # two batches handed out, the first one trained
    session.state.loaders = [train_loader.sampler.state_dict(), _loader(0, 1).sampler.state_dict()]
    session.begin_call()  # the re-entry: what the interrupted call prepared is let go
    assert session.loaders == []
    again = ray_elastic_train_torch().prepare_data_loader(DataLoader(TensorDataset(torch.arange(N)), batch_size=BS))
    test = ray_elastic_train_torch().prepare_data_loader(DataLoader(TensorDataset(torch.arange(N)), batch_size=BS))
    assert again.sampler.num_processed == BS, "the first prepared loader resumes the first committed position"
    assert test.sampler.num_processed == 0
    assert session.loaders == [again, test]


class _FakeShard:
    """A DataShard's iteration surface: one epoch of 3 batches per pass, its position kept in `epoch`."""

    def __init__(self) -> None:
        self.epoch = 0

    def iter_batches(self, **options):
        self.options = options
        yield from ((self.epoch, i) for i in range(3))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_each_pass_over_a_dataset_shard_is_an_epoch_as_in_ray_and_a_cut_pass_is_not():
    shard = _FakeShard()
    it = train_session.ShardIterator(shard)
    assert list(it.iter_batches(batch_size=2)) == [(0, 0), (0, 1), (0, 2)]
    cut = it.iter_batches(batch_size=2)
    next(cut)
    del cut  # a reset cuts the pass: the epoch does not advance
    assert shard.epoch == 1
    list(it.iter_batches(batch_size=2, prefetch_batches=4, batch_format="pandas"))
    assert shard.options == {"batch_size": 2, "prefetch_batches": 4, "batch_format": "pandas"}  # Ray's, as given
