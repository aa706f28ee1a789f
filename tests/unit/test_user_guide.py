"""The user guide against the code: every public name documented, every documented name importable.

A user reads a name in the guide and imports it, or finds a name with
`dir(ray_elastic)` and looks it up: both must work. The guide states what
the library does, so it holds no measurement diary (dates, "this machine",
issue numbers, "for now").
"""

from __future__ import annotations

import re
from pathlib import Path

import ray_elastic
import ray_elastic.torch
from ray_elastic.protocol import EventKind

GUIDE = (Path(__file__).parents[2] / "docs" / "user-guide.md").read_text()


def table_after(heading: str) -> list[list[str]]:
    """The rows (cells without backticks) of the first table after the line holding `heading`."""
    lines = GUIDE[GUIDE.index(heading) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("|"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip().startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
    return rows


def test_every_exported_name_is_in_the_guide():
    for module in (ray_elastic, ray_elastic.torch):
        missing = [n for n in module.__all__ if not re.search(rf"\b{re.escape(n)}\b", GUIDE)]
        assert not missing, f"{module.__name__} exports names the user guide never mentions: {missing}"


def test_every_exception_in_the_guides_table_is_importable_and_every_exported_one_is_in_it():
    listed = [row[0] for row in table_after("What `ray_elastic` raises")]
    for name in listed:
        assert isinstance(getattr(ray_elastic, name, None), type), f"the guide lists {name}; ray_elastic lacks it"
        assert issubclass(getattr(ray_elastic, name), Exception), name
    exported = [n for n in ray_elastic.__all__ if isinstance(getattr(ray_elastic, n), type)]
    exported = [n for n in exported if issubclass(getattr(ray_elastic, n), Exception)]
    assert sorted(listed) == sorted(exported), "the exceptions table and ray_elastic's exceptions differ"


def test_the_events_table_lists_every_event_kind_once():
    kinds = [row[0] for row in table_after("**Events**")]
    assert sorted(kinds) == sorted(str(k) for k in EventKind), "the guide's event table and EventKind differ"


def test_the_guide_holds_no_measurement_diary():
    diary = re.compile(
        r"(?i)this machine|this project's|\b20\d\d-\d\d-\d\d|\bissue[ -]\d|not built yet|for now|this release"
    )
    found = [line.strip()[:100] for line in GUIDE.splitlines() if diary.search(line)]
    assert not found, f"the user guide reads as a development log here: {found}"
