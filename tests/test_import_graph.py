"""Imports go one way: no cycle between the repository's Python files.

The graph is built with `ast` from every .py file of the repository (inference_fleet,
cell_constructs, stacks, app.py, the container packages, the Lambda, e2e, bench, the
tests), with every import statement counted, those inside functions too: a lazy import
hides a cycle from the interpreter's start-up order, not from a reader.

An edge goes to the most specific file an import names: `from a.b import c` points at
a/b/c.py when it exists, otherwise at a/b.py or a/b/__init__.py. A submodule is not given
an edge to its parent package's __init__.py (the interpreter does import it first), so a
package may re-export its submodules' names without that counting as a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where a top-level name is found: the repository root (inference_fleet, cell_constructs,
# stacks, bench), and the folders whose packages are installed or put on sys.path.
SOURCE_ROOTS = (
    ROOT,
    ROOT / "containers" / "inference",
    ROOT / "containers" / "proxy",
    ROOT / "functions" / "placement",
)
_SKIPPED_DIRS = {"node_modules", "cdk.out", "__pycache__"}

Graph = dict[Path, set[Path]]


def python_files(root: Path) -> list[Path]:
    """Every .py file under root, leaving out virtual environments, caches and build output."""
    return sorted(
        path for path in root.rglob("*.py")
        if not any(part.startswith(".") or part in _SKIPPED_DIRS or part.endswith(".egg-info")
                   for part in path.relative_to(root).parts[:-1])
    )


def _module_file(base: Path, dotted: str) -> Path | None:
    target = base.joinpath(*dotted.split(".")) if dotted else base
    for candidate in (target.with_suffix(".py"), target / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _resolve(name: str, search: Iterable[Path]) -> Path | None:
    """The file of module `name` (or of its longest importable prefix) in the first root that has it."""
    for base in search:
        parts = name.split(".")
        while parts:
            found = _module_file(base, ".".join(parts))
            if found is not None:
                return found
            parts.pop()
    return None


def _roots_of(path: Path, roots: tuple[Path, ...]) -> list[Path]:
    # A script outside any package (e2e/*.py, tests) also imports from its own folder:
    # e2e puts itself on sys.path, pytest's importlib mode imports tests by path.
    own = [] if (path.parent / "__init__.py").is_file() else [path.parent]
    return [*own, *roots]


def imports_of(path: Path, roots: tuple[Path, ...] = SOURCE_ROOTS) -> set[Path]:
    """The repository files that `path` imports."""
    search = _roots_of(path, roots)
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, search) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            targets = _from_targets(path, node, search)
        else:
            continue
        found.update(t for t in targets if t is not None and t != path)
    return found


def _from_targets(path: Path, node: ast.ImportFrom, search: list[Path]) -> list[Path | None]:
    if node.level:
        # Relative: from the file's package, one folder up per extra dot.
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        module = node.module or ""
        return [_module_file(base, f"{module}.{a.name}".strip(".")) or _module_file(base, module)
                for a in node.names]
    module = node.module or ""
    return [_resolve(f"{module}.{alias.name}", search) for alias in node.names]


def import_graph(root: Path = ROOT, roots: tuple[Path, ...] = SOURCE_ROOTS) -> Graph:
    return {path: imports_of(path, roots) for path in python_files(root)}


def cycles(graph: Graph) -> list[list[Path]]:
    """One concrete cycle (first file repeated at the end) per strongly connected group of files."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    on_stack: set[Path] = set()
    groups: list[set[Path]] = []

    def visit(node: Path) -> None:  # Tarjan's algorithm; the graph has a few hundred files
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_one_cycle(graph, group) for group in groups]


def _one_cycle(graph: Graph, group: set[Path]) -> list[Path]:
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first inside the group, back to start: the shortest cycle through it
        node = frontier.pop(0)
        for succ in sorted(graph[node] & group):
            if succ == start:
                return [*paths[node], start]
            if succ not in paths:
                paths[succ] = [*paths[node], succ]
                frontier.append(succ)
    raise AssertionError("a strongly connected group always has a cycle")


def _names(cycle: list[Path], root: Path = ROOT) -> str:
    return " -> ".join(str(p.relative_to(root)) for p in cycle)


def test_no_import_cycle_in_the_repository() -> None:
    found = cycles(import_graph())
    hint = "import cycles (break each: e.g. move the shared piece into its own module):"
    assert not found, "\n  ".join([hint, *(_names(c) for c in found)])


def test_the_graph_sees_the_imports_that_matter() -> None:
    """The check is not vacuous: known edges of each kind are found."""
    graph = import_graph()
    edges = {(str(a.relative_to(ROOT)), str(b.relative_to(ROOT))) for a, targets in graph.items() for b in targets}
    for edge in (
        ("app.py", "inference_fleet/checks.py"),  # from x import name
        ("inference_fleet/cli.py", "inference_fleet/planner/cli.py"),  # from package import submodule
        ("inference_fleet/checks.py", "inference_fleet/planner/fit.py"),
        ("containers/inference/unit_launcher/cli.py", "containers/inference/unit_launcher/runner.py"),  # in a function
        ("e2e/unit_mode.py", "e2e/harness.py"),  # a script's own folder
        ("containers/inference/unit_launcher/cli.py", "inference_fleet/checks.py"),  # across source roots
    ):
        assert edge in edges, edge
    assert len(graph) > 50


def test_a_cycle_is_found_and_named(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Re-exports: no cycle."""\nfrom pkg.a import A\n')
    (pkg / "a.py").write_text("from pkg.b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a\n")
    found = cycles(import_graph(tmp_path, (tmp_path,)))
    assert [_names(c, tmp_path) for c in found] == ["pkg/a.py -> pkg/b.py -> pkg/c.py -> pkg/a.py"]
