"""The README's example, run as a user runs it: saved as a script and executed, on the local cluster.

What a reader who copies it would notice if it broke: it raises, trains
nothing (the loss stays where it started), loses or repeats an epoch, or
prints something other than what the README says it prints. The first
example of docs/getting-started.md is the same code, so this one run covers both.
"""

from __future__ import annotations

import math
import re
import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme_example() -> str:
    """The README's runnable example: its one Python block that builds an `ElasticTrainer` and fits it."""
    blocks = [b for b in _PYTHON_BLOCK.findall((ROOT / "README.md").read_text()) if ".fit()" in b]
    assert len(blocks) == 1, f"expected one runnable example in README.md, found {len(blocks)}"
    return blocks[0]


def test_getting_started_opens_with_the_readme_example():
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    first_example = guide[guide.index("## A first example") :]
    assert readme_example() in _PYTHON_BLOCK.findall(first_example)[:1], "getting-started.md's first example differs"


def test_the_readme_example_trains_and_prints_its_summary(cluster, no_leaks, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(readme_example())
    result = runpy.run_path(str(script), run_name="__main__")["result"]

    metrics, world = result.metrics_history, result.events[-1].world_size
    assert [e.kind for e in result.events] == ["start"], f"a fault-free run had membership events: {result.events}"
    assert sorted({m["epoch"] for m in metrics}) == [0, 1, 2, 3, 4], "an epoch was lost or never reported"
    steps_per_epoch = math.ceil(4096 / (32 * world))
    assert len(metrics) == 5 * steps_per_epoch, f"{len(metrics)} steps at world size {world}"
    assert metrics[0]["loss"] > 1.0 and result.return_value < 1e-3, (
        f"the regression did not train: first loss {metrics[0]['loss']}, final {result.return_value}"
    )
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(rf"loss \d+\.\d\d -> \S+ after {len(metrics)} steps", printed), printed
