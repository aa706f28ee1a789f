"""docs/ray-train.md's table holds every public name of the installed Ray's `ray.train` and `ray.train.torch`.

For each name of their `__all__` (Ray Train v2's, 2.60's default, which
adds sixteen names to `ray.train`), a row says supported, supported with a
difference, or refused. A name Ray adds makes this fail until the table
says what happens to it; a name marked supported must import from
`ray_elastic.train` or `ray_elastic.train.torch`; one marked "Ray's own" must
be Ray's very object; one refused at its import must raise the `ImportError`
the row quotes.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

pytest.importorskip("ray.train")

import ray.train  # noqa: E402
import ray.train.torch  # noqa: E402

PAGE = Path(__file__).parents[2] / "docs" / "ray-train.md"
STATUSES = ("supported", "supported with a difference", "refused")
OURS = {"ray.train": "ray_elastic.train", "ray.train.torch": "ray_elastic.train.torch"}
_ROW = re.compile(r"^\| `(ray\.train(?:\.torch)?)\.(\w+)` \| ([^|]+?) \| (.+) \|$", re.M)


def _table() -> dict[tuple[str, str], tuple[str, str]]:
    rows = {}
    for module, name, status, text in _ROW.findall(PAGE.read_text()):
        assert (module, name) not in rows, f"{module}.{name} has two rows"
        rows[(module, name)] = (status, text)
    return rows


def _public(module: str) -> set[tuple[str, str]]:
    return {(module, name) for name in importlib.import_module(module).__all__}


def test_every_public_name_of_ray_train_and_ray_train_torch_has_a_row_and_no_row_is_stale():
    table = set(_table())
    public = _public("ray.train") | _public("ray.train.torch")
    assert "ReportedCheckpoint" in ray.train.__all__, "Ray Train v2 is what ray_elastic.train runs"
    assert not public - table, f"names of the installed Ray missing from docs/ray-train.md: {sorted(public - table)}"
    assert not table - public, f"rows for names the installed Ray does not export: {sorted(table - public)}"


def test_each_row_says_supported_supported_with_a_difference_or_refused_and_what():
    for (module, name), (status, text) in _table().items():
        assert status in STATUSES, f"{module}.{name}: {status!r}"
        if status != "supported":
            assert text.strip(), f"{module}.{name} is {status} without saying what"


def test_what_is_marked_supported_imports_from_ray_elastic_and_rays_own_is_rays_object():
    for (module, name), (status, text) in _table().items():
        if status == "refused":
            continue
        ours = importlib.import_module(OURS[module])
        assert hasattr(ours, name), f"{module}.{name} is marked {status} but {OURS[module]} lacks it"
        assert name in ours.__all__, f"{OURS[module]}.__all__ lacks {name}"
        if text.startswith("Ray's own"):
            assert getattr(ours, name) is getattr(importlib.import_module(module), name), f"{name} is not Ray's own"


def test_a_name_refused_at_its_import_raises_the_import_error_its_row_quotes():
    refused_at_import = 0
    for (module, name), (status, text) in _table().items():
        if status != "refused":
            continue
        ours = importlib.import_module(OURS[module])
        try:
            getattr(ours, name)
        except ImportError as e:
            refused_at_import += 1
            assert f"`ImportError: {e}`" in text, f"{module}.{name}'s row does not quote its error"
            with pytest.raises(ImportError, match=re.escape(str(e))):
                exec(f"from {OURS[module]} import {name}", {})
        else:
            assert "Error" in text or "Warning" in text, f"{module}.{name}: refused where, with which error?"
    assert refused_at_import == 2  # get_preemption_info and PreemptionInfo


def test_ray_trains_own_deprecated_torch_utilities_refuse_as_ray_does():
    from ray_elastic.train.torch import accelerate, backward, prepare_optimizer

    for refused in (lambda: accelerate(), lambda: backward(None), lambda: prepare_optimizer(None)):
        with pytest.raises(DeprecationWarning, match="deprecated"):
            refused()
