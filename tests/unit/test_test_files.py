"""The test tree as pytest collects it: `make test` runs tests/unit and tests/integration in one session.

The test directories are not packages (conftest.py puts tests/support on the
path), so pytest imports each test file by its basename: two files of one
name stop the whole collection ("import file mismatch") and no test runs.
"""

from __future__ import annotations

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_no_two_test_files_share_a_name():
    names = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" not in path.parts:
            names[path.name].append(str(path.relative_to(TESTS)))
    shared = {n: paths for n, paths in names.items() if len(paths) > 1 and n not in ("__init__.py", "conftest.py")}
    assert not shared, f"modules pytest would import under one name: {shared}"
