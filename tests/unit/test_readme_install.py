"""What the README tells a new user to run exists, and the user-facing pages carry no history.

A reader follows the README to the letter: a `make` target it names that the
Makefile lacks, an extra in its `pip install` lines that pyproject.toml does
not declare (pip only warns, and the feature then fails at import), or an
example file that moved, is a first step that fails. The README and the
migration guides are read long after they were written, so they say how
things are, not when or where someone measured them: no dates, no "this
machine", no "issue N".
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
USER_PAGES = [README, *sorted((ROOT / "docs").glob("migrating-*.md"))]

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
# `make demo`, `make PY=python3.12 test`, `make -j2 test-unit`: the target after any options and variables
_MAKE = re.compile(r"(?:^|[\s;&(])make[ \t]+(?:-\S+[ \t]+|[A-Za-z_][A-Za-z0-9_]*=\S*[ \t]+)*([A-Za-z0-9][\w.-]*)")
# `.[torch,data]`, `'.[tune]'`, `ray-elastic[lightning]`
_EXTRAS = re.compile(r"(?:(?<![\w/])\.|ray-elastic)\[([^\]]*)\]")
_EXAMPLE = re.compile(r"\bexamples/[\w-]+(?:\.[A-Za-z0-9]+)*")
_RULE = re.compile(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", re.M)
_PHONY = re.compile(r"^\.PHONY\s*:(.*)$", re.M)
_EXTRAS_TABLE = re.compile(r"^\[project\.optional-dependencies\]\n(.*?)(?=^\[|\Z)", re.S | re.M)
_TOML_KEY = re.compile(r"^([A-Za-z0-9][\w.-]*)\s*=", re.M)

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
HISTORY = {
    "a date": re.compile(rf"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])\b|\b(?:{_MONTHS})\s+(?:\d{{1,2}},?\s+)?20\d\d\b"),
    '"this machine"': re.compile(r"\bthis\s+machine\b", re.I),
    "an issue number": re.compile(r"\bissues?\s+#?\d+", re.I),
}


def code_text(markdown: str) -> str:
    """The README's code: fenced blocks and inline code spans, one per line."""
    return "\n".join(_FENCE.findall(markdown) + _CODE_SPAN.findall(_FENCE.sub("", markdown)))


def make_targets_named(markdown: str) -> set[str]:
    return set(_MAKE.findall(code_text(markdown)))


def makefile_targets(makefile: str) -> set[str]:
    targets = set(_RULE.findall(makefile))
    for phony in _PHONY.findall(makefile):
        targets.update(phony.split())
    return targets


def declared_extras(pyproject: str) -> set[str]:
    """The names in pyproject.toml's [project.optional-dependencies] (read as text: tomllib needs Python 3.11)."""
    table = _EXTRAS_TABLE.search(pyproject)
    return set(_TOML_KEY.findall(table.group(1))) if table else set()


def extras_named(markdown: str) -> set[str]:
    """The extras of every `pip install` line, in code blocks and inline code alike."""
    found = set()
    for line in code_text(markdown).splitlines():
        if "pip install" in line:
            for group in _EXTRAS.findall(line.split("#", 1)[0]):
                found.update(e.strip() for e in group.split(",") if e.strip())
    return found


def examples_named(markdown: str) -> set[str]:
    return set(_EXAMPLE.findall(markdown))


def history_in(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, rule in HISTORY.items() for m in rule.finditer(text)]


def test_the_parsers_find_what_a_reader_would():
    page = (
        "Run `make demo`, or `make PY=python3.12 test`; let `make` do it.\n"
        "```bash\nmake test-unit   # fast\npip install -e '.[torch,data]'   # [not, an, extra]\n"
        "pip install 'ray-elastic[tune]'\n```\n"
        "See `examples/digits.py:train_fn` and examples/notebook.ipynb. Also [a link](docs/x.md).\n"
    )
    assert make_targets_named(page) == {"demo", "test", "test-unit"}
    assert extras_named(page) == {"torch", "data", "tune"}
    assert examples_named(page) == {"examples/digits.py", "examples/notebook.ipynb"}
    assert makefile_targets(".PHONY: demo lint\n$(STAMP): pyproject.toml\ndemo: $(STAMP)\nPY ?= python3\n") == {
        "demo",
        "lint",
    }
    toml = '[project]\nname = "x"\n[project.optional-dependencies]\n# c\ntorch = ["torch"]\n'
    toml += 'test = [\n  "a",\n]\n[tool.x]\ny = 1\n'
    assert declared_extras(toml) == {"torch", "test"}
    assert len(history_in("measured 2026-11-25 on this machine (issue 34); March 3, 2025")) == 4
    assert history_in("Ray 2.60, torch 2.13.0, 4096 samples, [Horovod #3143](https://x/issues/3143)") == []


def test_every_make_target_the_readme_names_is_in_the_makefile():
    named = make_targets_named(README.read_text())
    assert {"demo", "test"} <= named, f"the README no longer names its set-up commands: it names {sorted(named)}"
    missing = named - makefile_targets((ROOT / "Makefile").read_text())
    assert not missing, f"README.md names make targets the Makefile does not have: {sorted(missing)}"


def test_every_extra_the_readme_installs_is_declared_in_pyproject():
    named = extras_named(README.read_text())
    assert named, "README.md has no pip install line with extras"
    declared = declared_extras((ROOT / "pyproject.toml").read_text())
    missing = named - declared
    assert not missing, (
        f"README.md installs extras pyproject.toml does not declare: {sorted(missing)} (declared: {sorted(declared)})"
    )


def test_every_example_file_the_readme_names_exists():
    named = examples_named(README.read_text())
    assert named, "README.md names no file under examples/"
    missing = sorted(name for name in named if not (ROOT / name).is_file())
    assert not missing, f"README.md names example files that do not exist: {missing}"


@pytest.mark.parametrize("page", USER_PAGES, ids=[str(p.relative_to(ROOT)) for p in USER_PAGES])
def test_the_page_carries_no_dates_machines_or_issue_numbers(page: Path):
    found = history_in(page.read_text())
    assert not found, f"{page.relative_to(ROOT)} says when or where, not what: " + "; ".join(found)


def test_make_demo_docs_rewrites_the_readmes_output_block_and_picture_from_one_run(tmp_path, monkeypatch):
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from demo import update_readme
    finally:
        sys.path.remove(str(ROOT / "examples"))
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    printed = tmp_path / "printed.txt"
    printed.write_text("[ray-elastic] started with 4 workers in 1.0 s\nthis run's lines\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo_output").mkdir()
    (tmp_path / "demo_output" / "timeline.png").write_bytes(b"png of this run")
    update_readme(printed, readme, tmp_path / "picture.png")
    text = readme.read_text()
    block = "[ray-elastic] started with 4 workers in 1.0 s\nthis run's lines\n"
    assert "<!-- demo output: make demo-docs -->\n```\n" + block + "```\n" in text
    assert text.count("this run's lines") == 1 and "make demo-docs" in text
    assert (tmp_path / "picture.png").read_bytes() == b"png of this run"
    outside = (ROOT / "README.md").read_text().split("<!-- demo output")[0]
    assert text.startswith(outside), "nothing outside the block changed"
