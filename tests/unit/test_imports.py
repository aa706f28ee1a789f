"""The package's import graph has no cycle, counting imports inside functions too.

Every `ray_elastic` import is read with `ast` (nothing is imported): the
module-level ones, and those inside functions, which must not be there to
dodge a cycle. An import inside a function is allowed (the backend factory
imports torch and pygloo backends on first use, so a numpy-only worker never
loads them), but adding it to the graph must not close a cycle: moving any
such import to module level keeps the package importable. Imports under
`if TYPE_CHECKING:` count too: they never run, but a module that names
another's types in its signatures depends on it, and a circle of such
dependences is a layering the reader has to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "ray_elastic"


def _modules(package: Path) -> dict[str, Path]:
    modules = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str]:
    """The package's modules an import statement loads (`from a import b` is module `a.b` if there is one)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    found = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


def import_graph(package_dir: Path = PACKAGE) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """Edges between the package's modules, and the imports made inside functions or classes."""
    modules = _modules(package_dir)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    inner: list[tuple[str, str, int]] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        top_level = {id(n) for n in tree.body} | {
            id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try)) for n in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, package, modules):
                if target == module:
                    continue
                edges[module].add(target)
                if id(node) not in top_level:
                    inner.append((module, target, node.lineno))
    return edges, inner


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it starts, or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for target in sorted(edges[module]):
            if target in on_path:
                return path[path.index(target) :] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        on_path.discard(path.pop())
        done.add(module)
        return None

    for module in sorted(edges):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle_even_counting_imports_inside_functions():
    edges, inner = import_graph()
    cycle = find_cycle(edges)
    where = {(m, t): line for m, t, line in inner}
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {where[(a, b)]}, inside a function)" if (a, b) in where else a
        for a, b in zip(cycle, cycle[1:] + [""], strict=True)
    )


def test_the_cycle_finder_finds_a_cycle_closed_by_an_import_inside_a_function():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_an_import_for_types_only_closes_a_cycle_too(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import High\n")
    (pkg / "high.py").write_text("from pkg import low\nclass High: ...\n")
    edges, _ = import_graph(pkg)
    assert find_cycle(edges) == ["pkg.high", "pkg.low", "pkg.high"]


def test_the_graph_sees_the_package_as_it_is():
    edges, inner = import_graph()
    assert "ray_elastic.collective.base" in edges["ray_elastic.collective.torch_dist"]
    assert "ray_elastic.collective.activity" in edges["ray_elastic.collective.base"]
    assert ("ray_elastic.collective.factory", "ray_elastic.collective.nccl") in {(m, t) for m, t, _ in inner}


def test_every_module_says_what_it_owns_in_its_docstring():
    """A newcomer opens a file and reads its first lines: each module (`__init__` too) opens with its job."""
    silent = [str(path) for path in _modules(PACKAGE).values() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not silent, f"modules without a docstring saying what they own: {silent}"
