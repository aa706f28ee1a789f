"""docs/refusals.md, the one page of what the library refuses, against the code's own lists of refusals.

A user who meets a refusal looks it up on that page, reached from
docs/index.md. Where the code keeps its refusals as a table (Ray Train's
config fields and `TorchTrainer` keywords, Horovod's names and reduce ops
without a counterpart, the keywords `prepare_model` and Lightning's strategy
set themselves, the FSDP2 keywords `prepare_model` takes, Hugging Face's
reasons), each entry must be named in the page's section for it: an entry
added to one of them without a line on the page fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

DOCS = Path(__file__).parents[2] / "docs"
PAGE = (DOCS / "refusals.md").read_text()


def section(heading: str) -> str:
    """The page's text under `## heading` (its `###` subsections included), up to the next `## `."""
    start = PAGE.index(f"\n## {heading}\n")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start : end if end != -1 else None]


def not_named(names: object, text: str) -> list[str]:
    """The names that `text` does not write as code (`name`, or inside a code span)."""
    spans = " ".join(code for _, code in re.findall(r"(`+)(.+?)\1(?!`)", text))  # `x` and ``x `y` z``
    return [n for n in map(str, names) if not re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", spans)]


def test_the_page_is_linked_from_the_index():
    assert "](refusals.md)" in (DOCS / "index.md").read_text(), "docs/index.md does not link docs/refusals.md"


def test_every_ray_train_config_field_and_trainer_keyword_refused_is_named():
    pytest.importorskip("ray.train")
    from ray_elastic.train.config import _REFUSED, REFUSED_TRAINER_ARGS

    text = section("Ray Train scripts")
    assert not not_named(REFUSED_TRAINER_ARGS, text), "TorchTrainer keywords refused but not on the page"
    for config, fields in _REFUSED.items():
        assert not not_named([config.__name__], text), f"{config.__name__} is refused in part but not on the page"
        missing = not_named(fields, text)
        assert not missing, f"{config.__name__} fields refused but not on the page: {missing}"


def test_every_horovod_name_and_reduce_op_without_a_counterpart_is_named():
    pytest.importorskip("torch")
    from ray_elastic.horovod.torch import _UNSUPPORTED, ops

    text = section("Horovod scripts")
    assert not not_named(_UNSUPPORTED, text), "hvd names refused but not on the page"
    refused_ops = [f"hvd.{v.name}" for v in vars(ops).values() if isinstance(v, ops.UnsupportedOp)]
    assert refused_ops, "no reduce op found refused: is UnsupportedOp still how they are refused?"
    assert not not_named(refused_ops, text), "hvd reduce ops refused but not on the page"


def test_the_keywords_prepare_model_and_the_lightning_strategy_refuse_are_named():
    pytest.importorskip("torch")
    from ray_elastic.torch import ddp
    from ray_elastic.torch.sharded import wrap

    assert not not_named(ddp._OWN_OPTIONS, section("Inside `train_fn`")), "prepare_model's own keywords"
    assert not not_named(wrap.OPTIONS, section("Sharded models (FSDP2)")), "prepare_model's FSDP2 keywords"
    pytest.importorskip("lightning")
    from ray_elastic.lightning import core, prepare

    text = section("PyTorch Lightning")
    assert not not_named(core._RING_OPTIONS, text), "the keywords ElasticDDPStrategy sets itself"
    assert not not_named(core._COMM_HOOK_OPTIONS, text), "the DDP communication hooks ElasticDDPStrategy refuses"
    strategies = [s for s in prepare._SHARDED if not re.search(rf"\b{s}\b", text)]
    assert not strategies, f"sharded Lightning strategies refused but not on the page: {strategies}"


def test_every_reason_hugging_faces_adapter_gives_is_named():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from ray_elastic.transformers import refusals

    args = SimpleNamespace(
        deepspeed="ds.json",
        fsdp="full_shard",
        push_to_hub=True,
        auto_find_batch_size=True,
        group_by_length=True,
        train_sampling_strategy="group_by_length",
        n_gpu=2,
    )
    reasons = refusals(SimpleNamespace(args=args, model_init=lambda: None, train_dataset=None))
    assert len(reasons) >= 9, f"a Trainer with everything refused gave only {reasons}"
    text = section("Hugging Face Transformers")
    for reason in reasons:
        head = re.sub(r"'[^']*'", "", reason.split(":")[0])  # what it names, without the user's values
        names = [w for w in re.findall(r"[A-Za-z_][\w.]*", head) if re.search(r"[_.A-Z]", w)] or head.split()[:1]
        missing = [n for n in names if n not in text]
        assert not missing, f"the page's Hugging Face section lacks {missing}, named by the refusal {reason!r}"
