"""Every `make` command README.md and CONTRIBUTING.md offer starts as documented.

A reader runs `make soak` or `make bench` as a page says: the target must
exist, its recipe must name scripts that exist, and a script it runs must
import from a fresh checkout (`make soak` once failed at its first import,
`conftest` no longer on its path). `make -n` prints a recipe without running
it, so each offered target is checked in milliseconds; the runs themselves
(minutes, clusters) are the lanes' and the soak's own.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme_install import make_targets_named, makefile_targets

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
MAKEFILE = (ROOT / "Makefile").read_text()


def offered_targets() -> list[str]:
    named: set[str] = set()
    for page in PAGES:
        named |= make_targets_named(page.read_text())
    return sorted(named)


def scripts_in(recipe: str) -> list[str]:
    """The repository files a printed recipe runs with Python (`.venv/bin/python bench/x.py ...`)."""
    return re.findall(r"python3?\S*\s+((?:bench|tests|examples)/[\w/.-]+\.py)", recipe)


def test_the_pages_offer_the_commands_they_are_known_for():
    assert {"demo", "test", "test-unit", "soak", "bench", "venv", "lint"} <= set(offered_targets())


def test_every_offered_target_is_in_the_makefile():
    missing = set(offered_targets()) - makefile_targets(MAKEFILE)
    assert not missing, f"README.md or CONTRIBUTING.md offer make targets the Makefile lacks: {sorted(missing)}"


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make not installed")
@pytest.mark.parametrize("target", offered_targets())
def test_every_offered_target_dry_runs_and_names_scripts_that_exist(target: str):
    # TORCH_INDEX= : no 5 s probe of PyTorch's index at parse time; -n prints the recipe, runs nothing
    done = subprocess.run(
        ["make", "-n", target, "TORCH_INDEX="], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"make -n {target} fails: {done.stderr}"
    missing = [s for s in scripts_in(done.stdout) if not (ROOT / s).is_file()]
    assert not missing, f"make {target} runs scripts that do not exist: {missing}"


def test_the_recipe_parser_finds_the_scripts():
    recipe = ".venv/bin/python tests/support/soak.py --events 30\n.venv/bin/python bench/straggler.py --arms x\n"
    assert scripts_in(recipe) == ["tests/support/soak.py", "bench/straggler.py"]


def test_the_soak_script_finds_its_helpers_when_make_soak_runs_it_alone(monkeypatch):
    """`python tests/support/soak.py` has only its own folder on the path, not pytest's: it adds what it imports."""
    tests_dir = str(ROOT / "tests")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p).resolve() != Path(tests_dir).resolve()])
    monkeypatch.delitem(sys.modules, "conftest", raising=False)
    monkeypatch.setenv("RAY_CLIENT_MODE", "0")  # recorded, so what importing Ray sets there is put back
    monkeypatch.delenv("RAY_CLIENT_MODE")
    spec = importlib.util.spec_from_file_location("soak_as_make_runs_it", ROOT / "tests" / "support" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    found = importlib.util.find_spec("conftest")
    assert found is not None and Path(str(found.origin)) == ROOT / "tests" / "conftest.py"
