"""The rest of Ray Train's surface its docs use, no Ray cluster: `Result`, `DataConfig`, the failure, the trainer.

- `Result` is Ray's (a subclass), and `Result.from_path` reads back what a
  run wrote under `Result.path`: the reports go through `ray_elastic.train.
  report()` and the report store on a Gloo ring of one in this process.
- `DataConfig`: `datasets_to_split` and `execution_options` honoured, a custom
  `configure()` refused by name; a dataset left whole reaches each worker as
  Ray's own `DataIterator`.
- `fit()`'s failure is caught by `except ray.train.TrainingFailedError`.
- `DataParallelTrainer` runs a plain loop; `TorchTrainer` is one.

Ray itself is never started: `ray.init` raises here, and the datasets are
built from a logical plan, as Ray Data's read functions would after starting Ray.
"""

from __future__ import annotations

import pickle
import warnings
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.train")

import cloudpickle  # noqa: E402
import pyarrow.fs  # noqa: E402
import ray  # noqa: E402
import ray.data  # noqa: E402
import ray.train  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ring_runtime import RingRuntime  # noqa: E402

import ray_elastic  # noqa: E402
import ray_elastic.train as train  # noqa: E402
from ray_elastic.collective.torch_gloo import TorchGlooGroup  # noqa: E402
from ray_elastic.runtime.process import set_current  # noqa: E402
from ray_elastic.shipping import unpack  # noqa: E402
from ray_elastic.train import session as train_session  # noqa: E402
from ray_elastic.train import trainer as train_trainer  # noqa: E402
from ray_elastic.train.report_store import INDEX_FILE  # noqa: E402
from ray_elastic.train.torch import TorchConfig, TorchTrainer  # noqa: E402


@pytest.fixture(autouse=True)
def _no_ray(monkeypatch):
    """Nothing here may start Ray (another process may be using this machine's)."""

    def refused(*args, **kwargs):
        raise AssertionError("a unit test started Ray")

    monkeypatch.setattr(ray, "init", refused)
    monkeypatch.setattr(ray._private.worker, "init", refused)


def _loop(config):
    return config


# ---- Result: Ray's fields, and from_path on what a run writes ---------------------------------------------


class _WorldOfOne(RingRuntime):
    """A worker's runtime as far as `report()` asks it: rank 0 of 1 on a ring of this process."""

    generation = 1

    def __init__(self, ring) -> None:
        super().__init__(ring, host="h")
        self.slot = SimpleNamespace(host="h", rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
        self.reports: list[dict] = []

    def report(self, metrics) -> None:
        self.reports.append(dict(metrics))

    def ring_failure(self, error):
        return None


@pytest.fixture
def worker(tmp_path, monkeypatch):
    """A worker in its loop: `Result.path` is tmp_path/exp, two durable checkpoints kept (num_to_keep=2)."""
    ring = TorchGlooGroup(dist.HashStore(), 0, 1, 30.0)
    runtime = _WorldOfOne(ring)
    set_current(runtime)
    session = train_session.Session("exp", None, str(tmp_path / "exp"), num_to_keep=2)
    (tmp_path / "exp").mkdir()
    monkeypatch.setattr(train_session, "_SESSION", session)
    try:
        yield SimpleNamespace(session=session, path=tmp_path / "exp", runtime=runtime)
    finally:
        set_current(None)
        session.close()
        ring.close()


def _report_epoch(tmp_path, epoch: int, loss: float) -> None:
    directory = tmp_path / f"save{epoch}"
    directory.mkdir()
    (directory / "model.pt").write_bytes(bytes([epoch]) * 10)
    train.report({"epoch": epoch, "loss": loss}, checkpoint=train.Checkpoint.from_directory(str(directory)))


def test_from_path_reads_back_the_checkpoints_a_run_kept_with_their_reports_metrics(worker, tmp_path):
    for epoch, loss in enumerate([0.9, 0.5, 0.25]):
        _report_epoch(tmp_path, epoch, loss)
        train.report({"step_loss": loss})  # no checkpoint: not a commit, not listed
    result = train.Result.from_path(str(worker.path))
    assert isinstance(result, ray.train.Result) and isinstance(result, train.Result)
    assert [m["epoch"] for _, m in result.best_checkpoints] == [1, 2], "num_to_keep=2: the newest two"
    assert result.metrics == {"epoch": 2, "loss": 0.25}
    assert result.checkpoint.path == str(worker.path / "checkpoint_000003")
    with result.checkpoint.as_directory() as d:
        assert open(f"{d}/model.pt", "rb").read() == bytes([2]) * 10
    assert result.metrics_dataframe["loss"].tolist() == [0.5, 0.25]
    assert isinstance(result.filesystem, pyarrow.fs.LocalFileSystem)
    assert result.path == str(worker.path) and result.error is None
    assert result.get_best_checkpoint("loss", "min").path == result.checkpoint.path  # Ray's own method
    assert sorted(p.name for p in worker.path.iterdir()) == ["checkpoint_000002", "checkpoint_000003", INDEX_FILE]
    # and in the loop, the same list
    reported = train.get_all_reported_checkpoints()
    assert [(r.checkpoint.path, r.metrics["epoch"], r.status) for r in reported] == [
        (str(worker.path / "checkpoint_000002"), 1, ray.train.ReportedCheckpointStatus.COMMITTED),
        (str(worker.path / "checkpoint_000003"), 2, ray.train.ReportedCheckpointStatus.COMMITTED),
    ]


def test_from_path_takes_a_uri_or_a_filesystem_and_metrics_json_cannot_hold(worker, tmp_path):
    import numpy as np
    import torch

    directory = tmp_path / "save"
    directory.mkdir()
    (directory / "w").write_bytes(b"w")
    metrics = {"loss": np.float32(0.5), "per_class": torch.tensor([1.0, 2.0]), "note": object}
    train.report(metrics, checkpoint=train.Checkpoint.from_directory(str(directory)), checkpoint_dir_name="best")
    by_uri = train.Result.from_path(f"file://{worker.path}/")
    on_fs = train.Result.from_path(str(worker.path), storage_filesystem=pyarrow.fs.LocalFileSystem())
    for result in (by_uri, on_fs):
        assert result.path == str(worker.path)
        assert result.checkpoint.path == str(worker.path / "best")
        assert result.metrics["loss"] == 0.5 and result.metrics["per_class"] == [1.0, 2.0]
        assert result.metrics["note"] == str(object)


def test_from_path_refuses_a_missing_directory_and_one_no_checkpoint_was_reported_to(tmp_path):
    with pytest.raises(RuntimeError, match="doesn't exist"):
        train.Result.from_path(str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match=f"{INDEX_FILE} doesn't exist"):
        train.Result.from_path(str(tmp_path))


def test_a_checkpoint_pruned_after_the_list_was_written_is_left_out(worker, tmp_path):
    for epoch in (0, 1):
        _report_epoch(tmp_path, epoch, 1.0 / (epoch + 1))
    (worker.path / "checkpoint_000002" / "model.pt").unlink()
    (worker.path / "checkpoint_000002").rmdir()
    result = train.Result.from_path(str(worker.path))
    assert [c.path for c, _ in result.best_checkpoints] == [str(worker.path / "checkpoint_000001")]
    assert result.metrics == {"epoch": 0, "loss": 1.0}


def _outcome(durable, value="done"):
    return ray_elastic.Result(
        return_value=(value, durable),
        metrics_history=[{"loss": 1.0}, {"loss": 0.5}],
        metric_times=[1.0, 2.0],
    )


def test_fit_returns_rays_result_with_every_field_and_writes_what_from_path_reads(tmp_path, monkeypatch):
    run = tmp_path / "exp"
    (run / "checkpoint_000001").mkdir(parents=True)
    trainer = TorchTrainer(_loop, run_config=train.RunConfig(name="exp", storage_path=str(tmp_path)))
    monkeypatch.setattr(trainer.trainer, "fit", lambda: _outcome([["checkpoint_000001", {"loss": 1.0}]]))
    result = trainer.fit()
    assert isinstance(result, ray.train.Result)
    assert isinstance(result.filesystem, pyarrow.fs.LocalFileSystem)
    assert result.path == str(run) and result.error is None and result.return_value == "done"
    assert result.metrics == {"loss": 0.5}, "rank 0's last report"
    assert result.metrics_dataframe["loss"].tolist() == [1.0, 0.5], "every report of rank 0"
    assert result.checkpoint.path == str(run / "checkpoint_000001")
    assert [(c.path, m) for c, m in result.best_checkpoints] == [(str(run / "checkpoint_000001"), {"loss": 1.0})]
    assert result.elastic.metrics_history == [{"loss": 1.0}, {"loss": 0.5}]
    again = train.Result.from_path(result.path)
    assert again.metrics == {"loss": 1.0} and again.checkpoint.path == result.checkpoint.path


# ---- the failure, as Ray Train's scripts catch it ---------------------------------------------------------


def test_a_failed_fit_is_caught_by_except_ray_train_training_failed_error(monkeypatch):
    trainer = TorchTrainer(_loop)

    def fails():
        error = ray_elastic.TrainingFailedError("train_fn raised in worker w1 (rank 0): ValueError: bad", 7)
        error.extra = "kept"
        raise error

    monkeypatch.setattr(trainer.trainer, "fit", fails)
    try:
        trainer.fit()
    except ray.train.TrainingFailedError as e:
        caught = e
    assert isinstance(caught, ray_elastic.TrainingFailedError) and isinstance(caught, train.TrainingFailedError)
    assert str(caught) == "train_fn raised in worker w1 (rank 0): ValueError: bad"
    assert (caught.return_value, caught.extra) == (7, "kept")
    back = pickle.loads(pickle.dumps(caught))  # what a Tune trial or a Ray task would do with it
    assert type(back) is train.TrainingFailedError and str(back) == str(caught) and back.return_value == 7
    assert train.TrainingFailedError is not ray_elastic.TrainingFailedError


# ---- DataConfig ----------------------------------------------------------------------------------------------


def _dataset():
    """A Ray Dataset built from its logical plan (Ray Data's read functions would start Ray)."""
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators.input_data_operator import InputData
    from ray.data._internal.stats import DatasetStats

    with warnings.catch_warnings():  # copy() reads the context's deprecated settings too
        warnings.simplefilter("ignore", DeprecationWarning)
        context = ray.data.DataContext.get_current().copy()  # as the read functions give each dataset its own
    plan = LogicalPlan(InputData(input_data=[]), context)
    return ray.data.Dataset(plan, context, DatasetStats(metadata={}, parent=None))


def _loop_reading(config):
    ray.train.get_dataset_shard("train")
    ray.train.get_dataset_shard("valid")


def test_datasets_to_split_splits_those_named_and_gives_the_others_whole_to_every_worker(monkeypatch):
    datasets = {"train": _dataset(), "valid": _dataset()}
    trainer = TorchTrainer(
        _loop_reading, datasets=datasets, dataset_config=train.DataConfig(datasets_to_split=["train", "absent"])
    )
    assert set(trainer.trainer.datasets) == {"train", "valid"}, "both reach the run (the feed streams what is asked)"
    # in a worker: what the driver shipped, unpickled
    loop, _ = unpack(trainer.trainer._payload)
    monkeypatch.setattr(train_session, "_SESSION", train_session.Session("exp", None))
    asked = {}

    def in_the_loop(self, config):
        asked["valid"] = train.get_dataset_shard("valid")
        asked["train"] = train_trainer.whole_dataset("train")

    monkeypatch.setattr(train_session.PerWorker, "__call__", in_the_loop)
    loop({})
    assert isinstance(asked["valid"], ray.data.DataIterator), "Ray's own iterator over the whole dataset"
    assert asked["train"] is None, "a split dataset is the feed's, not whole"
    assert train_trainer.whole_dataset("valid") is None, "only while the loop runs"


def test_execution_options_go_on_each_dataset_as_rays_configure_sets_them():
    from ray.data import ExecutionOptions, ExecutionResources

    limited = ExecutionOptions(resource_limits=ExecutionResources(cpu=2))
    trainer = TorchTrainer(
        _loop_reading,
        datasets={"train": _dataset(), "valid": _dataset()},
        dataset_config=train.DataConfig(execution_options={"valid": limited}, datasets_to_split=["train"]),
    )
    assert trainer.trainer.datasets["valid"].context.execution_options == limited
    assert trainer.trainer.datasets["train"].context.execution_options.resource_limits.cpu != 2
    everywhere = TorchTrainer(
        _loop_reading,
        datasets={"train": _dataset(), "valid": _dataset()},
        dataset_config=train.DataConfig(execution_options=limited, enable_shard_locality=False),
    )
    assert all(d.context.execution_options == limited for d in everywhere.trainer.datasets.values())


def test_a_data_config_whose_configure_is_overridden_or_not_a_data_config_is_refused_by_name(monkeypatch):
    class MyConfig(ray.train.DataConfig):
        def configure(self, *args, **kwargs):
            return super().configure(*args, **kwargs)

    def spawned(*a, **k):
        raise AssertionError("nothing may be built before the refusal")

    monkeypatch.setattr(ray_elastic, "ElasticTrainer", spawned)
    with pytest.raises(ValueError, match=r"MyConfig\.configure\(\) is not supported"):
        TorchTrainer(_loop, datasets={"train": _dataset()}, dataset_config=MyConfig())
    with pytest.raises(ValueError, match="dataset_config must be a ray.train.DataConfig"):
        TorchTrainer(_loop, dataset_config={"datasets_to_split": "all"})


def test_the_private_names_of_rays_data_config_read_here_exist():
    config = ray.train.DataConfig(datasets_to_split=["a"])
    assert config._datasets_to_split == ["a"]
    assert config._get_user_execution_options("a") is None


# ---- DataParallelTrainer --------------------------------------------------------------------------------------


def _plain_loop():
    train.report({"rank": train.get_context().get_world_rank()})


def test_data_parallel_trainer_runs_a_plain_loop_and_torch_trainer_is_one(tmp_path):
    generic = train.DataParallelTrainer(
        _plain_loop,
        backend_config=train.BackendConfig(),
        scaling_config=train.ScalingConfig(num_workers=(2, 4)),
        run_config=train.RunConfig(name="plain", storage_path=str(tmp_path)),
    )
    cfg = generic.trainer.run_config
    assert (cfg.min_workers, cfg.max_workers) == (2, 4) and cfg.backend in ("gloo", "nccl")
    assert generic.trainer.train_fn.loop is _plain_loop and generic.path == str(tmp_path / "plain")
    torch_one = train.DataParallelTrainer(_plain_loop, backend_config=TorchConfig(backend="gloo"))
    assert torch_one.trainer.run_config.backend == "gloo"
    assert issubclass(TorchTrainer, train.DataParallelTrainer)


def test_data_parallel_trainer_refuses_another_frameworks_backend_and_names_itself_in_errors():
    class JaxLikeConfig(ray.train.BackendConfig):
        """Another framework's config, as ray.train.tensorflow's and ray.train.v2.jax's are."""

    with pytest.raises(ValueError, match=r"backend_config=JaxLikeConfig\(\.\.\.\) is not supported"):
        train.DataParallelTrainer(_plain_loop, backend_config=JaxLikeConfig())
    with pytest.raises(ValueError, match=r"DataParallelTrainer\(metadata=\.\.\.\) is not supported"):
        train.DataParallelTrainer(_plain_loop, metadata={"a": 1})
    with pytest.raises(ValueError, match="asks get_dataset_shard for .* but DataParallelTrainer was given"):
        train.DataParallelTrainer(_loop_reading, datasets={"train": _dataset()})


def test_the_loop_ships_to_the_workers_with_its_datasets():
    trainer = TorchTrainer(_loop, datasets={"v": _dataset()}, dataset_config=train.DataConfig(datasets_to_split=[]))
    loop = cloudpickle.loads(cloudpickle.dumps(trainer.trainer.train_fn))
    assert set(loop.whole) == {"v"} and loop.names_in_errors == ("train_loop_per_worker", "TorchTrainer")


# ---- ray.train.torch's device list ------------------------------------------------------------------------------


def test_get_devices_is_the_one_device_a_worker_trains_on_and_several_gpus_are_refused(monkeypatch):
    import ray_elastic.train.torch as train_torch

    assert train_torch.get_devices() == [train_torch.get_device()]
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [0, 1])
    with pytest.raises(ValueError, match="this worker holds 2 GPUs"):
        train_torch.get_devices()
