"""No import cycles in megatronapp/, read from the source (AST), not by importing it.

Two graphs are checked:
* modules: `a.b.c -> x.y` for every import anywhere in a.b.c: module level, inside functions
  and under `if TYPE_CHECKING:`. A function-level import defers a cycle to call time but
  does not remove it: the two modules still depend on each other, and moving one import to
  the top (or a refactor that calls the function at import) turns it into an ImportError.
* packages: the same edges collapsed to megatronapp's top-level packages and modules
  (`model`, `parallel`, `config`, ...), so that layering points one way (config below model,
  the engine below the modules that plug into it) even when no single module pair loops.

`from p import n` counts an edge to p (its __init__ runs) and to p.n when that is a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "megatronapp"

KNOWN_MODULE_CYCLES: list[set[str]] = []  # none: every entry here is a cycle still to remove


def list_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package directory)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported_names(node: ast.AST, package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: strip (level - 1) trailing parts of the containing package
            parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(parts + ([base] if base else []))
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return []


def build_import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported module inside `modules`: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for target in _imported_names(node, package):
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def collapse_to_packages(graph: dict[str, dict[str, int]], depth: int = 2) -> dict[str, dict[str, str]]:
    """The graph over names cut to `depth` parts; each edge keeps one module edge as evidence."""

    def cut(name: str) -> str:
        return ".".join(name.split(".")[:depth])

    collapsed: dict[str, dict[str, str]] = {cut(m): {} for m in graph}
    for src, targets in graph.items():
        for dst, line in targets.items():
            if cut(src) != cut(dst):
                collapsed[cut(src)].setdefault(cut(dst), f"{src}:{line} imports {dst}")
    return collapsed


def find_cycles(graph: dict[str, dict]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node, as a path
    [a, b, ..., a] (Tarjan's algorithm for the components, then a search inside each)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_path(graph, component) for component in components]


def _cycle_path(graph: dict[str, dict], component: set[str]) -> list[str]:
    """A simple cycle through the component's smallest node, found breadth-first."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        next_frontier = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:  # walk back v -> ... -> start, then close the loop
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if w in component and w not in parents:
                    parents[w] = v
                    next_frontier.append(w)
        frontier = next_frontier
    raise AssertionError(f"no cycle through {start} in a strongly connected component")


def describe(cycle: list[str], graph: dict[str, dict]) -> str:
    steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
    return "import cycle: " + "; ".join(steps)


@pytest.fixture(scope="module")
def module_graph():
    return build_import_graph(list_modules(PACKAGE_ROOT))


def test_no_module_import_cycle(module_graph):
    cycles = [c for c in find_cycles(module_graph) if set(c) not in KNOWN_MODULE_CYCLES]
    assert not cycles, "\n".join(describe(c, module_graph) for c in cycles)


def test_no_package_import_cycle(module_graph):
    packages = collapse_to_packages(module_graph)
    cycles = find_cycles(packages)
    assert not cycles, "\n".join(describe(c, packages) for c in cycles)


def test_known_cycles_still_exist(module_graph):
    """An allowed cycle that has been removed leaves the list, so the list only shrinks."""
    present = [set(c) for c in find_cycles(module_graph)]
    gone = [sorted(c) for c in KNOWN_MODULE_CYCLES if c not in present]
    assert not gone, f"remove from KNOWN_MODULE_CYCLES (no longer a cycle): {gone}"


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from pkg.c import g\n",
            "pkg/c.py": "from . import a\n",
            "pkg/d.py": "import pkg.a\n",  # into the cycle, not part of it
        },
    )
    graph = build_import_graph(list_modules(pkg))
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    assert describe(find_cycles(graph)[0], graph) == (
        "import cycle: pkg.a -> pkg.b (1); pkg.b -> pkg.c (2); pkg.c -> pkg.a (1)"
    )


def test_finds_a_package_cycle_without_a_module_cycle(tmp_path):
    """config imports model.recompute and model.gpt imports config: no module loops, the
    packages do."""
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/config.py": "from pkg.model.recompute import X\n",
            "pkg/model/__init__.py": "",
            "pkg/model/recompute.py": "X = 1\n",
            "pkg/model/gpt.py": "from pkg.config import Y\n",
        },
    )
    graph = build_import_graph(list_modules(pkg))
    assert find_cycles(graph) == []
    assert find_cycles(collapse_to_packages(graph)) == [["pkg.config", "pkg.model", "pkg.config"]]
