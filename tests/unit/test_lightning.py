"""The Lightning adapter without Ray: refusals, the LR rescale, the resumed epoch's loader, the op names.

The rollback tests run Lightning's own fit and restore in this process, as rank 0 of a one-rank Gloo ring.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import pytorch_lightning
import torch
from test_worker_runtime import no_ray, world_of_one  # noqa: F401 - fixtures
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ray_elastic.lightning import ElasticDDPStrategy, ElasticEnvironment, prepare_trainer
from ray_elastic.lightning.core import EpochLoader, _op_name, rescale_lr
from ray_elastic.torch import ElasticSampler


def trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, **kwargs)


def test_max_time_is_refused_before_training_naming_it():
    with pytest.raises(ValueError, match="max_time"):
        prepare_trainer(trainer(max_time="00:00:10:00", strategy=ElasticDDPStrategy(), plugins=[ElasticEnvironment()]))


def test_several_devices_per_worker_are_refused():
    with pytest.raises(ValueError, match="devices=1"):
        prepare_trainer(trainer(devices=2, strategy=ElasticDDPStrategy(), plugins=[ElasticEnvironment()]))


def test_a_sharded_strategy_is_refused_naming_it():
    class DeepSpeedStrategy(pl.strategies.SingleDeviceStrategy):  # stands for the real one (not installed here)
        pass

    t = trainer()
    t._accelerator_connector.strategy = DeepSpeedStrategy(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="DeepSpeedStrategy strategy shards the model"):
        prepare_trainer(t)


def test_a_trainer_with_lightnings_defaults_gets_the_elastic_strategy():
    t = prepare_trainer(trainer(max_epochs=1))
    assert isinstance(t.strategy, ElasticDDPStrategy)
    assert isinstance(t.strategy.cluster_environment, ElasticEnvironment)
    assert t.strategy.commits in t.callbacks


def test_pytorch_lightning_trainers_get_their_own_packages_classes():
    from ray_elastic.lightning import pytorch_lightning as elastic_ptl

    t = prepare_trainer(
        pytorch_lightning.Trainer(accelerator="cpu", logger=False, strategy=elastic_ptl.ElasticDDPStrategy())
    )
    assert isinstance(t.strategy, pytorch_lightning.strategies.DDPStrategy)
    assert isinstance(t.strategy.cluster_environment, elastic_ptl.ElasticEnvironment)


def test_the_ring_decides_the_process_group():
    with pytest.raises(ValueError, match="process_group"):
        ElasticDDPStrategy(process_group=None)
    with pytest.raises(ValueError, match="commit_every"):
        ElasticDDPStrategy(commit_every=0)


def test_rescale_lr_scales_groups_and_scheduler_bases_alike():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    sched.step()  # lr 0.05
    rescale_lr([opt], [sched], 4 / 2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert sched.base_lrs == [pytest.approx(0.2)]


def test_lightnings_reduce_ops_map_to_the_librarys():
    assert _op_name("mean") == "average" and _op_name(None) == "average"
    assert _op_name(torch.distributed.ReduceOp.SUM) == "sum"
    with pytest.raises(ValueError, match="mean, sum"):
        _op_name("product")


def test_a_batch_counts_as_trained_when_its_step_ends_not_when_lightning_fetches_it_ahead():
    """Lightning fetches one batch ahead: counting batches as handed out skipped one batch per rank at a rollback."""
    data = TensorDataset(torch.arange(40))
    sampler = ElasticSampler(data, shuffle=False)
    sampler.set_world(0, 2)
    loader = EpochLoader(DataLoader(data, batch_size=4, sampler=sampler), sampler, offset=0)
    assert len(loader) == 5  # 20 indices for rank 0 of 2, batches of 4
    it = iter(loader)
    next(it), next(it), next(it)  # batches 0 and 1 stepped on, batch 2 fetched ahead
    loader.trained(0), loader.trained(1)
    committed = sampler.state_dict()  # a commit after the second step
    assert sampler.num_processed == 16, "two batches on each of 2 ranks; the batch fetched ahead is not trained"

    fresh = ElasticSampler(data, shuffle=False)
    fresh.load_state_dict(committed)
    fresh.set_world(0, 3)  # resumed on a smaller ring
    resumed = EpochLoader(DataLoader(data, batch_size=4, sampler=fresh), fresh, offset=2)
    assert len(resumed) == 2 + 2  # 24 left over 3 ranks: 8 each, 2 batches, after the 2 committed
    for batch_idx, _ in enumerate(resumed, start=2):  # Lightning numbers the resumed epoch's batches from 2
        resumed.trained(batch_idx)
    assert fresh.num_remaining == 0


class _Indexed(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return i, torch.full((2,), i / 40)


class _Failing(Exception):
    pass


class _Recording(pl.LightningModule):
    """Records the samples each epoch trained; the record is in its checkpoint, so it rolls back with a commit."""

    def __init__(self, fail_at: set[int]) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.seen: list[tuple[int, list[int]]] = []
        self.fail_at = fail_at  # global steps that raise once, as a lost ring does

    def training_step(self, batch, batch_idx):
        ids, x = batch
        if self.global_step in self.fail_at:
            self.fail_at.discard(self.global_step)
            raise _Failing
        self.seen.append((self.current_epoch, ids.tolist()))
        return self.net(x).pow(2).mean()

    def on_save_checkpoint(self, checkpoint):
        checkpoint["seen"] = list(self.seen)

    def on_load_checkpoint(self, checkpoint):
        self.seen = list(checkpoint["seen"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize(
    "commit_every, fail_at",
    [(3, set()), (3, {7}), (3, {9}), (3, {10}), (3, {3, 14}), (5, {11}), (5, {10, 21}), (5, {9, 20, 29})],
)
@pytest.mark.usefixtures("world_of_one")
def test_each_epoch_trains_every_sample_once_through_rollbacks_to_mid_epoch_commits(commit_every, fail_at):
    """Failures after commits mid-epoch, on an epoch's last batch and on the next's first: 3 epochs of 10 batches.

    Lightning resumed at the batch the commit's step ended, and the loader's
    length must count that batch too; the epoch after a resumed one must be
    as long as any other. Both once lost a batch or a whole epoch.
    """
    from ray_elastic.lightning.prepare import LightningState, enter_fit

    model = _Recording(set(fail_at))
    t = prepare_trainer(
        trainer(
            max_epochs=3,
            strategy=ElasticDDPStrategy(commit_every=commit_every),
            plugins=[ElasticEnvironment()],
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
    )
    state = LightningState(t)
    t.strategy.commits.state = state
    state.save()  # what the run loop holds before the first fit: no commit yet
    loader = DataLoader(_Indexed(), batch_size=4, shuffle=True)
    # a LightningDataModule's loader takes the same way as a DataLoader given to fit: alternate between them
    data = {"datamodule": pl.LightningDataModule.from_datasets(_Indexed(), batch_size=4)} if commit_every == 5 else {}
    for _ in range(len(fail_at) + 1):  # what @elastic.run does after each failure: enter fit again
        try:
            given = data or {"train_dataloaders": loader}
            type(t).fit(t, model, **given, ckpt_path=enter_fit(t.strategy, state, None))
            break
        except _Failing:
            continue
    for epoch in range(3):
        assert sorted(i for e, ids in model.seen if e == epoch for i in ids) == list(range(40)), epoch
    assert t.global_step == 30


class _FailsInBackward(torch.autograd.Function):
    """Raises in backward once the layers after it have their gradients: a ring lost in the middle of backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise _Failing


class _TwoLayers(pl.LightningModule):
    def __init__(self, fail_at: set[int]) -> None:
        super().__init__()
        self.first = torch.nn.Linear(2, 4)
        self.second = torch.nn.Linear(4, 1)
        self.fail_at = fail_at

    def training_step(self, batch, batch_idx):
        _, x = batch
        hidden = self.first(x)
        if self.global_step in self.fail_at:
            self.fail_at.discard(self.global_step)
            hidden = _FailsInBackward.apply(hidden)
        return self.second(hidden).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.usefixtures("world_of_one")
def test_a_fit_entered_again_after_a_failure_mid_backward_trains_on():
    """The failed fit's DDP had counted the second layer's gradients when its backward failed; left hooked on the
    parameters, it counted them again in the next fit's first backward, which then failed ("marked ready twice")."""
    from ray_elastic.lightning.prepare import LightningState, enter_fit

    model = _TwoLayers({4})
    t = prepare_trainer(
        trainer(
            max_epochs=1,
            strategy=ElasticDDPStrategy(commit_every=2),
            plugins=[ElasticEnvironment()],
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
    )
    state = LightningState(t)
    t.strategy.commits.state = state
    state.save()
    loader = DataLoader(_Indexed(), batch_size=4, shuffle=True)
    with pytest.raises(_Failing):
        type(t).fit(t, model, train_dataloaders=loader, ckpt_path=enter_fit(t.strategy, state, None))
    type(t).fit(t, model, train_dataloaders=loader, ckpt_path=enter_fit(t.strategy, state, None))
    assert t.global_step == 10


@pytest.mark.usefixtures("world_of_one")
def test_the_ddp_setup_lightning_runs_on_a_gpu_wraps_the_model_elastic(monkeypatch):
    """With a CUDA root device Lightning's `configure_ddp` registers DDP comm hooks and asserts the model is a torch
    DistributedDataParallel: every `accelerator="gpu"` fit failed there. The CUDA branch, taken on the CPU."""
    from ray_elastic.torch.ddp import ElasticDDP

    strategy = ElasticDDPStrategy()
    monkeypatch.setattr(ElasticDDPStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
    strategy.model = _TwoLayers(set())
    strategy.configure_ddp()
    assert isinstance(strategy.model, ElasticDDP) and isinstance(strategy.model.module, _TwoLayers)


@pytest.mark.parametrize("option", ["ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period"])
def test_a_ddp_comm_hook_is_refused_naming_it(option):
    with pytest.raises(ValueError, match=option):
        ElasticDDPStrategy(**{option: 4 if option == "model_averaging_period" else (lambda *a: None)})
