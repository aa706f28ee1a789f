"""The options table is the one declaration of every option: each view of an option follows from its row."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from ray_elastic import ElasticTrainer, options
from ray_elastic.cli import build_parser
from ray_elastic.config import RunConfig
from ray_elastic.horovod.ray.settings import ElasticSettings, MiniSettings
from ray_elastic.options import BY_NAME, CONCERNS, OPTIONS, from_horovod

# ElasticTrainer's arguments that are not options of the run: what runs, where, and what fit() shows
NOT_OPTIONS = {"train_fn", "config", "discovery", "verbose"}


def test_every_option_has_a_known_concern_and_one_row():
    assert len(BY_NAME) == len(OPTIONS)
    assert {o.concern for o in OPTIONS} <= set(CONCERNS)
    assert {"scaling", "failure", "timeouts", "checkpoint", "data"} <= {o.concern for o in OPTIONS}


def test_the_trainers_keywords_are_the_table_and_their_defaults_its_defaults():
    params = inspect.signature(ElasticTrainer).parameters
    assert set(params) - NOT_OPTIONS == set(BY_NAME)
    for name, param in params.items():
        if name in BY_NAME and name not in ("min_workers", "max_workers", "datasets"):
            assert param.default == BY_NAME[name].default, name
    for o in OPTIONS:
        assert f"{o.name}:" in ElasticTrainer.__doc__, f"the trainer's docstring does not document {o.name}"


# ElasticTrainer's signature before the options table: a call written for it keeps its meaning
BEFORE = [
    *("train_fn", "min_workers", "max_workers", "config", "resources_per_worker", "discovery", "backend"),
    *("elastic_timeout", "reset_limit", "cooldown_range", "discovery_interval", "discovery_timeout"),
    *("liveness_timeout", "collective_timeout", "max_failures", "checkpoint_dir", "checkpoint_every"),
    *("checkpoint_keep", "keep_metrics", "datasets", "data_cpus", "data_starvation_timeout", "evict_stragglers"),
    "verbose",
]


def test_the_trainers_existing_keywords_keep_their_order_and_new_options_are_keyword_only():
    params = list(inspect.signature(ElasticTrainer).parameters.values())
    assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == BEFORE
    assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == ["checkpoint_timeout", "spares"]


def test_run_config_has_a_field_per_option_with_the_tables_default():
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    assert set(BY_NAME) <= set(fields)
    for o in OPTIONS:
        if o.name not in ("min_workers", "max_workers", "resources_per_worker", "backend"):
            assert fields[o.name].default == o.default, o.name


def test_the_cli_has_a_flag_per_option_with_help_and_its_default():
    args = build_parser().parse_args(["run", "f.py:train", "--min-workers", "1"])
    for o in OPTIONS:
        if o.help is not None and o.name not in ("min_workers",):
            assert getattr(args, o.name) == o.default, o.name
    values = options.cli_values(
        build_parser().parse_args(
            ["run", "f.py:train", "--min-np", "2", "--checkpoint-timeout", "7", "--blacklist-cooldown-range", "1", "2"]
        )
    )
    assert values["min_workers"] == 2 and values["checkpoint_timeout"] == 7.0 and values["cooldown_range"] == (1.0, 2.0)


def test_horovod_settings_map_through_the_table():
    assert from_horovod(MiniSettings(timeout_s=12)) == {"collective_timeout": 12}
    mapped = from_horovod(ElasticSettings(min_num_proc=2, max_num_proc=None, reset_limit=3, timeout_s=30))
    assert mapped == {"min_workers": 2, "reset_limit": 3, "elastic_timeout": 600, "collective_timeout": 30}


def test_checkpoint_io_has_its_own_timeout_which_defaults_to_the_collectives():
    cfg = RunConfig.create(min_workers=1, max_workers=1, resources_per_worker=None, backend="gloo")
    assert cfg.checkpoint_timeout is None and cfg.worker("r").checkpoint_timeout == cfg.collective_timeout
    own = RunConfig.create(
        min_workers=1, max_workers=1, resources_per_worker=None, backend="gloo", checkpoint_timeout=9
    )
    assert own.worker("r").checkpoint_timeout == 9.0 and own.worker("r").collective_timeout == 300.0
    with pytest.raises(ValueError, match="checkpoint_timeout must be a positive number of seconds"):
        RunConfig.create(min_workers=1, max_workers=1, resources_per_worker=None, checkpoint_timeout=0)


def test_replace_checks_the_options_it_changes_and_keeps_the_rest():
    cfg = RunConfig.create(min_workers=1, max_workers=3, resources_per_worker={"CPU": 2}, backend="auto")
    changed = cfg.replace(resources_per_worker={"CPU": 0.001}, reserved_cpus=2.0)
    assert changed.resources_per_worker == {"CPU": 0.001} and changed.reserved_cpus == 2.0
    assert changed.max_workers == 3 and changed.backend == cfg.backend and changed.backend_requested == "auto"
    with pytest.raises(ValueError, match="max_workers"):
        cfg.replace(max_workers=0)
    with pytest.raises(TypeError, match="unknown option"):
        cfg.replace(no_such_option=1)


def test_a_variant_of_a_trainer_merges_its_config_and_checks_its_changed_options():
    from ray_elastic.shipping import unpack

    def train(config):
        return config

    trainer = ElasticTrainer(train, min_workers=1, max_workers=2, config={"lr": 0.1, "epochs": 2}, verbose=0)
    trial = trainer.variant(config={"lr": 0.5}, discovery=dict, resources_per_worker={"CPU": 0.001}, reserved_cpus=1.0)
    fn, config = unpack(trial._payload)
    assert config == trial.config == {"lr": 0.5, "epochs": 2} and fn(config) == config
    assert trainer.config == {"lr": 0.1, "epochs": 2} and trainer.run_config.reserved_cpus is None
    assert trial.run_config.resources_per_worker == {"CPU": 0.001} and trial.run_config.reserved_cpus == 1.0
    assert unpack(trial.discovery) is dict
    with pytest.raises(ValueError, match="checkpoint_keep"):
        trainer.variant(checkpoint_keep=0)


def test_a_variant_of_a_trainer_shipped_without_its_train_fn_takes_it_from_the_payload():
    from ray_elastic.shipping import unpack

    def train(config):
        return config

    trainer = ElasticTrainer(train, min_workers=1, max_workers=1, config={"a": 1}, verbose=0)
    trainer.train_fn = None  # as as_trainable() ships it to Tune
    fn, config = unpack(trainer.variant(config={"b": 2})._payload)
    assert fn(config) == {"a": 1, "b": 2}
