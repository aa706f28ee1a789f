"""Every relative link in README.md, CONTRIBUTING.md and docs/*.md leads somewhere.

A reader who clicks a link to a file that moved, or to a section whose
heading was renamed, lands nowhere: this checks each relative link's file
exists and, where it names an anchor, that the target markdown file has a
heading with that anchor (GitHub's rule: lower case, punctuation dropped,
spaces to hyphens, `-N` for repeats). Links to the web are not followed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = sorted(p for p in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")] if p.exists())

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The markdown without fenced code blocks (links inside them are code, not links)."""
    return _FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown page."""
    seen: dict[str, int] = {}
    found = set()
    for match in _HEADING.finditer(_prose(text)):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2))  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def relative_links(text: str) -> list[str]:
    prose = _CODE_SPAN.sub("", _prose(text))
    return [t for t in _LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_slug_rule_matches_githubs():
    text = "# A first example\n## The rules of `train_fn`\n## 5. commit(): model + Adam state\n## Data\n### Data\n"
    assert anchors(text) == {"a-first-example", "the-rules-of-train_fn", "5-commit-model--adam-state", "data", "data-1"}
    assert relative_links("[a](b.md#c) `[x](y.md)` [w](https://e.org) ![p](docs/p.png)") == ["b.md#c", "docs/p.png"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_points_to_an_existing_file_and_heading(page: Path):
    broken = []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)
