"""`ray_elastic.transformers` without Ray: what is refused, and the pieces the elastic Trainer is made of.

The whole adapter, through a SIGKILL and a node added, is exercised on the
cluster by `test_transformers_integration.py`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ray_elastic.transformers import prepare_trainer, refusals  # noqa: E402
from ray_elastic.transformers.trainer import _RecordingLoader, _TrainerStateHandle, _updates  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        ids = torch.full((4,), i)
        return {"input_ids": ids, "labels": ids}


def _args(**overrides) -> SimpleNamespace:
    base = {"deepspeed": None, "fsdp": None, "push_to_hub": False, "auto_find_batch_size": False, "n_gpu": 0}
    return SimpleNamespace(**{**base, **overrides})


def _trainer(args: SimpleNamespace, **overrides) -> SimpleNamespace:
    loop = {name: lambda *a: None for name in ("set_initial_training_values", "_init_training_state", "_run_epoch")}
    return SimpleNamespace(**{"args": args, "model_init": None, "train_dataset": Tokens(), **loop, **overrides})


def _tiny_trainer(tmp_path) -> transformers.Trainer:
    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=32, bos_token_id=0, eos_token_id=0
    )
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=5, use_cpu=True, report_to=[])
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens())


def test_a_plain_trainer_has_nothing_refused(tmp_path):
    assert refusals(_tiny_trainer(tmp_path)) == []


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"deepspeed": "ds_config.json"}, "DeepSpeed"),
        ({"fsdp": "full_shard"}, "FSDP"),
        ({"push_to_hub": True}, "push_to_hub"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"group_by_length": True}, "group_by_length"),
        ({"n_gpu": 2}, "several GPUs"),
    ],
)
def test_what_cannot_be_elastic_is_refused_before_training_by_name(overrides, named):
    trainer = _trainer(_args(**overrides))
    with pytest.raises(ValueError, match=named):
        prepare_trainer(trainer)
    assert not hasattr(trainer, "_ray_elastic"), "nothing of the Trainer was patched"


def test_a_transformers_without_the_loop_parts_is_refused_naming_its_version(tmp_path):
    trainer = _tiny_trainer(tmp_path)
    trainer._run_epoch = None  # as in transformers before 5.3, whose training loop is one method
    with pytest.raises(ValueError, match=rf"transformers {transformers.__version__}: .*_run_epoch.*>= 5\.3"):
        prepare_trainer(trainer)
    assert not hasattr(trainer, "_ray_elastic")


def test_a_model_init_or_an_unsized_dataset_is_refused():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from ()

    assert any("model_init" in r for r in refusals(_trainer(_args(), model_init=lambda: None)))
    assert any("__len__" in r for r in refusals(_trainer(_args(), train_dataset=Stream())))
    assert any("__len__" in r for r in refusals(_trainer(_args(), train_dataset=None)))


def test_trainer_state_rolls_back_in_place_but_keeps_the_ranks_own_flags():
    state = transformers.TrainerState(global_step=7, epoch=1.5, log_history=[{"loss": 2.0}])
    state.is_world_process_zero = False
    trainer = SimpleNamespace(state=state)
    handle = _TrainerStateHandle(trainer)
    saved = handle.state_dict()
    state.global_step, state.epoch = 12, 2.25
    state.log_history.append({"loss": 1.0})
    state.is_world_process_zero = True  # this rank became rank 0 meanwhile
    handle.load_state_dict(saved)
    assert trainer.state is state  # the Trainer's object, not a copy
    assert (state.global_step, state.epoch, state.log_history) == (7, 1.5, [{"loss": 2.0}])
    assert state.is_world_process_zero is True
    handle.load_state_dict(saved)
    state.log_history.append({"loss": 0.5})
    assert saved["log_history"] == [{"loss": 2.0}], "a restore hands out a copy of the commit"


def test_the_loader_records_what_was_handed_out_when_a_step_ends():
    from ray_elastic.torch import ElasticSampler

    sampler = ElasticSampler(Tokens(), shuffle=False)
    sampler.set_world(0, 2)
    loader = _RecordingLoader(Tokens(), batch_size=2, sampler=sampler)
    it = iter(loader)
    next(it)
    next(it)
    loader.record_trained()  # a step of 2 batches on each of 2 ranks: 8 samples
    next(it)  # fetched, then the step failed: not trained
    assert sampler.num_processed == 8
    assert len(loader) == 3
    loader.set_epoch(0)  # the epoch it is in: progress kept
    assert sampler.num_processed == 8
    loader.set_epoch(1)
    assert sampler.num_processed == 0


@pytest.mark.parametrize(
    ("samples", "size", "batch", "accumulation", "steps"),
    [(96, 4, 4, 1, 6), (96, 3, 4, 1, 8), (10, 4, 2, 1, 2), (10, 3, 2, 2, 1), (0, 2, 4, 1, 0)],
)
def test_optimizer_steps_follow_the_world_size(samples, size, batch, accumulation, steps):
    assert _updates(samples, size, batch, accumulation) == steps


def test_push_to_hub_is_refused_on_a_prepared_trainer():
    from ray_elastic.transformers.trainer import _refuse_push_to_hub

    with pytest.raises(RuntimeError, match="push_to_hub is refused"):
        _refuse_push_to_hub("model")
