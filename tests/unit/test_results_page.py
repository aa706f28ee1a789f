"""bench/RESULTS.md is a results page: a section for every benchmark, no development log.

Every script under bench/ that writes bench/results/<name>.json (through
bench/results_file.py's `write_results`, directly or through
bench/framework_compare.py) has a `## ` section of its own whose
**Command** line runs it. Every results file the page cites exists, and
every file in bench/results/ is cited: a figure a reader cannot trace to
its file, or a file no figure comes from, is a log, not a result. The page
carries no dates, no "issue N" references, no "this machine" / "this
session" and no run history ("second attempt", "an earlier run"), and it
stays short enough to read (600 lines at most).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
BENCH = ROOT / "bench"
PAGE = BENCH / "RESULTS.md"
RESULTS = BENCH / "results"
MAX_LINES = 600

# the helpers that write results for others: not benchmarks of their own
_WRITERS = {"results_file.py", "framework_compare.py"}


def benchmark_scripts() -> list[str]:
    """The bench/*.py scripts that write a results file, directly or through framework_compare."""
    found = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name in _WRITERS:
            continue
        text = path.read_text()
        if re.search(r"\bwrite_results\b", text) or re.search(r"^from framework_compare import", text, re.M):
            found.append(path.name)
    return found


def sections(text: str) -> dict[str, str]:
    """Each `## ` heading's title and the text under it, up to the next `## ` heading."""
    parts = re.split(r"^## +(.+?)\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def scripts_with_a_command(text: str) -> set[str]:
    """The scripts named on a **Command** line that opens a section's body."""
    named = set()
    for body in sections(text).values():
        for line in body.splitlines():
            if line.startswith("**Command**"):
                named.update(re.findall(r"bench/(\w+\.py)", line))
    return named


def diary_marks(text: str) -> list[str]:
    """Dates, issue references, 'this machine' / 'this session' and run history found in the text."""
    marks = re.findall(r"\b\d{4}-\d{2}-\d{2}\b", text)
    marks += re.findall(r"\bissues?\s+#?\d+", text, re.I)
    marks += re.findall(r"\bthis\s+(?:machine|session)\b", text, re.I)
    marks += re.findall(r"\b(?:second|third|first) (?:attempt|full run)\b|\ban earlier (?:run|version)\b", text, re.I)
    marks += re.findall(r"\bslightly older code\b|\bnot in the repository\b|\bflock\b", text, re.I)
    return marks


def cited_files(text: str) -> set[str]:
    """The results files the page names: `bench/results/x.json` or `x.json` alone."""
    return set(re.findall(r"(?<![\w<>-])([\w-]+\.json)\b", text))


def test_the_benchmarks_are_found():
    scripts = benchmark_scripts()
    assert {"recovery.py", "throughput.py", "state_size.py", "lightning.py", "transformers.py"} <= set(scripts)
    assert not {"cpu_account.py", "small_mlp.py", "turns.py"} & set(scripts)


def test_every_benchmark_has_a_section_with_its_command():
    named = scripts_with_a_command(PAGE.read_text())
    missing = [s for s in benchmark_scripts() if s not in named]
    assert not missing, f"bench/RESULTS.md has no section whose **Command** line runs: {', '.join(missing)}"


def test_the_page_reads_as_results_not_as_a_log():
    marks = diary_marks(PAGE.read_text())
    assert not marks, f"bench/RESULTS.md carries dates, issue numbers or 'this machine/session': {marks}"


def test_every_cited_results_file_exists_and_every_results_file_is_cited():
    cited = cited_files(PAGE.read_text())
    present = {p.name for p in RESULTS.glob("*.json")}
    assert cited, "bench/RESULTS.md cites no results file"
    assert not cited - present, f"bench/RESULTS.md cites files bench/results/ lacks: {sorted(cited - present)}"
    assert not present - cited, f"bench/results/ holds files no figure comes from: {sorted(present - cited)}"


def test_the_page_is_short_enough_to_read():
    lines = len(PAGE.read_text().splitlines())
    assert lines <= MAX_LINES, f"bench/RESULTS.md has {lines} lines; at most {MAX_LINES}: results, not their history"


def test_the_checks_catch_what_they_look_for():
    assert diary_marks("run on 2026-11-22; see issue 12, Issue #4; on This machine; this session") == [
        "2026-11-22",
        "issue 12",
        "Issue #4",
        "This machine",
        "this session",
    ]
    assert diary_marks("Second attempt, world 4; a run of slightly older code; `flock /tmp/x`") == [
        "Second attempt",
        "slightly older code",
        "flock",
    ]
    assert cited_files("Figures: `bench/results/a_1.json`; more, `b.json`; writes bench/results/<name>.json") == {
        "a_1.json",
        "b.json",
    }
    assert diary_marks("ray-project/ray#37633, 1024 ranks, 10-100 ms") == []
    page = "# R\n## A\n**Command**: `.venv/bin/python bench/a.py`\n## B\ntext naming bench/b.py\n"
    assert scripts_with_a_command(page) == {"a.py"}


def test_a_results_file_says_which_python_ray_and_torch_made_its_figures(tmp_path, monkeypatch):
    import json
    import platform
    from importlib import metadata

    monkeypatch.syspath_prepend(str(BENCH))
    import results_file

    monkeypatch.setattr(results_file, "__file__", str(tmp_path / "results_file.py"))  # writes under tmp_path
    meta = json.loads(results_file.write_results("versions", [{"x": 1}], note="n").read_text())["meta"]
    versions = (platform.python_version(), metadata.version("ray"), metadata.version("torch"))
    assert (meta["python"], meta["ray"], meta["torch"]) == versions
    assert meta["note"] == "n"
