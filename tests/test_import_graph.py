"""The module import graph of moebench has no cycle.

The graph is read from the source (AST), not by importing: every `import` / `from ... import` anywhere in a module
counts, function-level (lazy) imports included, because a lazy import still ties the two modules together; only
imports under `if TYPE_CHECKING:` are left out (they never run). An edge goes to the module named: `from a.b import
c` is a.b.c when c is a submodule, else a.b. Parent packages imported implicitly are not edges (a package's
__init__ importing its own submodules would otherwise look like a cycle with each of them).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "moebench"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Cycles still present in other areas of the redesign, each as the sorted tuple of its modules; removed by the
# core/dispatch branches. Tighten to an empty set once those branches are merged.
KNOWN_CYCLES: set[tuple[str, ...]] = set()  # none left: the package import graph is acyclic


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes of the tree, skipping the bodies of `if TYPE_CHECKING:` (their else branch still counts)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def import_graph(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    files = module_files() if files is None else files
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _base(module, is_package, node)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                # `import moebench.a.b` where only moebench.a exists (a name inside it): the nearest module
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Each strongly connected component of more than one module, sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_finder_sees_cycles_lazy_imports_and_skips_type_checking():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": set()}
    assert find_cycles(graph) == [("p.a", "p.b", "p.c")]
    assert find_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_graph_reads_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from pkg.top import g\n")
    (pkg / "top.py").write_text("from typing import TYPE_CHECKING\nfrom .sub.leaf import f\n"
                                "if TYPE_CHECKING:\n    from pkg import other\n")
    (pkg / "other.py").write_text("import pkg.top\n")
    graph = import_graph(module_files(pkg, "pkg"))
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}
    assert graph["pkg.sub.leaf"] == {"pkg.top"}  # a function-level import is an edge
    assert graph["pkg.top"] == {"pkg.sub.leaf"}  # the TYPE_CHECKING import is not
    assert graph["pkg.other"] == {"pkg.top"}
    assert find_cycles(graph) == [("pkg.sub.leaf", "pkg.top")]


def test_moebench_import_graph_has_no_cycle():
    cycles = set(find_cycles(import_graph()))
    assert cycles - KNOWN_CYCLES == set(), f"import cycles: {sorted(cycles - KNOWN_CYCLES)}"
    # A cycle that is gone must leave the allow-list, so the list only ever shrinks.
    assert KNOWN_CYCLES - cycles == set(), f"no longer cycles, drop from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - cycles)}"


def test_measurements_sit_below_the_runner_and_the_profiler():
    """measure/* is what the runner and the profiler build on: it imports neither."""
    graph = import_graph()
    above = ("moebench.runner", "moebench.profile")
    for module, targets in graph.items():
        if module.startswith("moebench.measure"):
            bad = sorted(t for t in targets if t.startswith(above))
            assert not bad, f"{module} imports {bad}"
