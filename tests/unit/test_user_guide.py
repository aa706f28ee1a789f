"""The user's pages (docs/*.md but the contributors' and the migration guides) against the code.

A user reads a name on a page and imports it, or finds a name with
`dir(ray_elastic)` and looks it up: both must work. So every public name is
on some page; every import in a page's Python blocks resolves; every
`ElasticTrainer(...)` keyword and `ray-elastic run` flag a page writes is
one the code takes; every event kind a page names is one a run records; the
options and events tables list each option and event kind once. Each page
opens with a contents list of its sections, and the pages state what the
library does, so they hold no measurement diary (dates, "this machine",
issue numbers, "for now").
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import inspect
import re
import textwrap
from pathlib import Path

import pytest

import ray_elastic
import ray_elastic.torch
from ray_elastic import ElasticTrainer
from ray_elastic.cli import build_parser
from ray_elastic.options import BY_NAME, OPTIONS
from ray_elastic.protocol import EventKind

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"
NOT_USER_PAGES = {"internals.md"}  # the contributors' page
PAGES = sorted(p for p in DOCS.glob("*.md") if p.name not in NOT_USER_PAGES and not p.name.startswith("migrating-"))
TEXT = {p.name: p.read_text() for p in PAGES}
ALL = "\n".join(TEXT.values())

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_HEADING = re.compile(r"^(#{2,3})\s+(.*?)\s*$", re.M)
EVENTS = {str(k) for k in EventKind}


def blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(text) if lang == language]


def table_after(text: str, heading: str) -> list[list[str]]:
    """The rows (cells without backticks) of the first table after the line holding `heading`."""
    lines = text[text.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip().startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
    return rows


def parsed(code: str) -> ast.Module | None:
    """A block as Python, or None for a fragment (a loop body, `...` lines) that is not a whole program."""
    try:
        return ast.parse(textwrap.dedent(code))
    except SyntaxError:
        return None


def imports_in(code: str) -> list[tuple[str, str | None]]:
    """(module, name) for every import of a block; name None for `import module`."""
    tree = parsed(code)
    if tree is None:  # a fragment: its import lines alone
        lines = [line.strip() for line in code.splitlines() if re.match(r"\s*(from \S+ )?import ", line)]
        tree = ast.parse("\n".join(lines))
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def unresolved(module: str, name: str | None) -> str | None:
    """Why `from module import name` (or `import module`) would fail here, or None."""
    try:
        if importlib.util.find_spec(module) is None:
            return f"no module {module}"
        if name is None:
            return None
        if hasattr(importlib.import_module(module), name):
            return None
        return None if importlib.util.find_spec(f"{module}.{name}") else f"{module} has no {name}"
    except ImportError as e:
        return f"{module}: {e}"


def trainer_keywords(code: str) -> set[str]:
    tree = parsed(code)
    if tree is None:
        return set()
    return {
        kw.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "ElasticTrainer"
        for kw in node.keywords
        if kw.arg
    }


def run_flags(code: str) -> set[str]:
    """The flags of every `ray-elastic run` command in a shell block (continuation lines joined; after ` -- `, the
    script's own arguments)."""
    joined = code.replace("\\\n", " ")
    commands = [line.split(" -- ")[0] for line in joined.splitlines() if "ray-elastic run" in line]
    return {f for command in commands for f in re.findall(r"\s(--[\w-]+)", command)}


def run_options() -> set[str]:
    """Every option string `ray-elastic run` takes."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for action in sub.choices["run"]._actions for s in action.option_strings}


def events_named(text: str) -> set[str]:
    """Event kinds a page names in prose: "event `x`", "events `x`, then `y`", "a `x` event"."""
    named = set(re.findall(r"\bevents? `(\w+)`", text)) | set(re.findall(r"`(\w+)` event", text))
    for first, then in re.findall(r"`(\w+)`,? then `(\w+)`", text):
        named |= {first, then}
    return named


def test_the_user_pages_are_found():
    assert {"index.md", "getting-started.md", "train-fn.md", "gpus.md", "options.md", "glossary.md"} <= set(TEXT)


def test_every_exported_name_is_on_a_page():
    for module in (ray_elastic, ray_elastic.torch):
        missing = [n for n in module.__all__ if not re.search(rf"\b{re.escape(n)}\b", ALL)]
        assert not missing, f"{module.__name__} exports names no page of docs/ mentions: {missing}"


def test_every_exception_in_the_errors_table_is_importable_and_every_exported_one_is_in_it():
    listed = [row[0] for row in table_after(TEXT["events-and-errors.md"], "## Errors")]
    for name in listed:
        assert isinstance(getattr(ray_elastic, name, None), type), f"the page lists {name}; ray_elastic lacks it"
        assert issubclass(getattr(ray_elastic, name), Exception), name
    exported = [n for n in ray_elastic.__all__ if isinstance(getattr(ray_elastic, n), type)]
    exported = [n for n in exported if issubclass(getattr(ray_elastic, n), Exception)]
    assert sorted(listed) == sorted(exported), "the exceptions table and ray_elastic's exceptions differ"


def test_the_events_table_lists_every_event_kind_once():
    kinds = [row[0] for row in table_after(TEXT["events-and-errors.md"], "## Events")]
    assert sorted(kinds) == sorted(EVENTS), "the events table and EventKind differ"


def test_the_options_table_lists_every_option_once_with_its_flag():
    rows = table_after(TEXT["options.md"], "## The trainer's options")
    names = [n.strip().strip("`") for row in rows for n in row[0].split(",")]
    assert sorted(names) == sorted({*BY_NAME, "config", "discovery", "verbose"}), (
        "options.md's table and the options differ"
    )
    flags = {n.strip().strip("`"): row[2] for row in rows for n in row[0].split(",")}
    for o in OPTIONS:
        if o.help is not None:
            assert o.flag in flags[o.name], f"options.md gives {o.name} the flag {flags[o.name]!r}, not {o.flag}"
        else:
            assert flags[o.name].startswith("none"), f"options.md gives {o.name} a flag; it has none"


def test_the_what_happens_when_table_names_real_events_and_options():
    rows = table_after(TEXT["what-happens-when.md"], "## The cases")
    assert len(rows) >= 20
    for case, _outcome, event, bound in rows:
        kinds = {k.strip().strip("`") for k in event.replace(", then ", ",").split(",")} - {"none"}
        assert kinds <= EVENTS, f"{case}: no event kind {kinds - EVENTS}"
        spans = re.findall(r"`([^`]+)`", f"`{bound}`" if "`" not in bound else bound)
        named = {w for span in spans for w in re.findall(r"\b[a-z]+_[a-z_]+\b|\bbackend\b", span)}
        assert named <= set(BY_NAME), f"{case}: not an option: {named - set(BY_NAME)}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_import_in_a_python_block_resolves(page: Path):
    failed = [
        why for code in blocks(TEXT[page.name], "python") for m, n in imports_in(code) if (why := unresolved(m, n))
    ]
    assert not failed, f"{page.name}: imports that fail: {failed}"


# the README, CONTRIBUTING.md and the migration guides write calls and commands too (their imports name the
# libraries users come from, which need not be installed here)
WRITING_PAGES = [*PAGES, ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("migrating-*.md"))]


@pytest.mark.parametrize("page", WRITING_PAGES, ids=[p.name for p in WRITING_PAGES])
def test_every_trainer_keyword_flag_and_event_a_page_writes_exists(page: Path):
    text = page.read_text()
    keywords = {k for code in blocks(text, "python") for k in trainer_keywords(code)}
    taken = set(inspect.signature(ElasticTrainer).parameters)
    assert keywords <= taken, f"{page.name} passes ElasticTrainer keywords it does not take: {keywords - taken}"
    known = run_options()
    flags = {f for code in blocks(text, "bash") for f in run_flags(code)}
    assert flags <= known, f"{page.name} writes ray-elastic run flags it does not have: {flags - known}"
    events = events_named(text)
    assert events <= EVENTS, f"{page.name} names event kinds a run never records: {events - EVENTS}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_page_opens_with_a_contents_list_of_its_sections(page: Path):
    text = TEXT[page.name]
    listed = set(re.findall(r"^\s*- \[[^\]]*\]\(#([^)]+)\)", text[: text.index("\n## ")], re.M))
    from test_docs_links import anchors

    headings = {a for a in anchors(text[text.index("\n## ") :])}
    missing = headings - listed
    assert not missing, f"{page.name}'s contents list lacks sections: {sorted(missing)}"


def test_the_checks_catch_what_they_look_for():
    assert imports_in("import torch\nfrom ray_elastic.lightning import prepare_trainer\n") == [
        ("torch", None),
        ("ray_elastic.lightning", "prepare_trainer"),
    ]
    assert imports_in("    for x in y:\n        ...\nfrom a.b import c\n") == [("a.b", "c")]
    assert unresolved("ray_elastic", "no_such_name") == "ray_elastic has no no_such_name"
    assert unresolved("no_such_module_here", None) == "no module no_such_module_here"
    assert unresolved("ray_elastic.torch", "get_device") is None
    assert trainer_keywords("elastic.ElasticTrainer(f, 1, 2, checkpoint_dirs='x')") == {"checkpoint_dirs"}
    assert run_flags("ray-elastic run a.py:f --min-workers 2 \\\n    --no-such-flag 1 -- --epochs 5\n") == {
        "--min-workers",
        "--no-such-flag",
    }
    assert events_named("the event `preempted`; events `restarted`, then `resumed`; a `kv_restart` event") == {
        "preempted",
        "restarted",
        "resumed",
        "kv_restart",
    }


def test_the_pages_hold_no_measurement_diary():
    diary = re.compile(
        r"(?i)this machine|this project's|\b20\d\d-\d\d-\d\d|\bissue[ -]#?\d|not built yet|for now|this release"
    )
    found = [
        f"{name}: {line.strip()[:80]}"
        for name, text in TEXT.items()
        for line in text.splitlines()
        if diary.search(line)
    ]
    assert not found, f"docs/ reads as a development log here: {found}"
