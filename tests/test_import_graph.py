"""The module import graph of moebench has no cycle.

The graph is read from the source (AST), not by importing: every `import` / `from ... import` node anywhere in a
module counts: module level, function level (lazy) and under `if TYPE_CHECKING:`, because each of them ties the two
modules together (a lazy import only hides the cycle until the call; a type-only import still means one module's
meaning depends on the other's). An edge goes to the module named: `from a.b import c` is a.b.c when c is a
submodule, else a.b. Importing a.b.c from outside the package a.b also runs a.b's `__init__`, so it is an edge to
a.b too; from inside a.b it is not (a package's __init__ importing its own submodules would otherwise look like a
cycle with each of them).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "moebench"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE



def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts])] = path
    return out


def _imports(tree: ast.AST):
    """Every import node of the tree, wherever it sits (functions, TYPE_CHECKING blocks, try/except...)."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


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
                    graph[module].update(_parents_run(module, target, files))
    return graph


def _parents_run(module: str, target: str, files: dict[str, Path]) -> set[str]:
    """The packages whose __init__ importing `target` runs for `module`: its parents that `module` is not in."""
    out = set()
    parent = target.rpartition(".")[0]
    while parent:
        if parent in files and not (module == parent or module.startswith(parent + ".")):
            out.add(parent)
        parent = parent.rpartition(".")[0]
    return out


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


def test_finder_sees_cycles():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}, "p.e": set()}
    assert find_cycles(graph) == [("p.a", "p.b", "p.c")]
    assert find_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def test_graph_reads_lazy_relative_type_checking_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from pkg.top import g\n")
    (pkg / "sub" / "twig.py").write_text("from pkg.sub.leaf import f\n")
    (pkg / "top.py").write_text("from typing import TYPE_CHECKING\nfrom .sub.twig import f\n"
                                "if TYPE_CHECKING:\n    from pkg import other\n")
    (pkg / "other.py").write_text("import pkg.top\n")
    (pkg / "alone.py").write_text("try:\n    import pkg.other\nexcept ImportError:\n    pass\n")
    graph = import_graph(module_files(pkg, "pkg"))
    assert graph["pkg.sub"] == {"pkg.sub.leaf"}  # a package's __init__ imports are edges
    assert graph["pkg.sub.leaf"] == {"pkg.top"}  # a function-level import is an edge
    assert graph["pkg.sub.twig"] == {"pkg.sub.leaf"}  # its own package's __init__ is not
    assert graph["pkg.top"] == {"pkg.sub.twig", "pkg.sub", "pkg.other"}  # TYPE_CHECKING counts; pkg.sub's
    # __init__ runs when pkg.sub.twig is imported from outside pkg.sub
    assert graph["pkg.other"] == {"pkg.top"}
    assert graph["pkg.alone"] == {"pkg.other"}  # under try
    assert find_cycles(graph) == [("pkg.other", "pkg.sub", "pkg.sub.leaf", "pkg.sub.twig", "pkg.top")]


def test_moebench_import_graph_has_no_cycle():
    assert find_cycles(import_graph()) == [], "import cycles (every import counts, lazy and TYPE_CHECKING too)"


def test_measurements_sit_below_the_runner_and_the_profiler():
    """measure/* is what the runner and the profiler build on: it imports neither."""
    graph = import_graph()
    above = ("moebench.run.runner", "moebench.profile")
    for module, targets in graph.items():
        if module.startswith("moebench.measure"):
            bad = sorted(t for t in targets if t.startswith(above))
            assert not bad, f"{module} imports {bad}"


def test_params_imports_nothing_of_moebench():
    """moebench.params is plain data at the bottom of the graph: every layer may read a point's parameters."""
    assert import_graph()["moebench.params"] == set()


# The layers the sweep loader validates against: they take Params from moebench.params, never moebench.run.sweep.
BELOW_THE_SWEEP = ("moebench.params", "moebench.registry", "moebench.families", "moebench.plugins",
                   "moebench.presets", "moebench.report.headline", "moebench.check", "moebench.run.strict_yaml",
                   "moebench.dispatch", "moebench.inputs", "moebench.kernels", "moebench.measure", "moebench.bench")


def test_nothing_the_sweep_loader_builds_on_imports_it():
    graph = import_graph()
    for module, targets in graph.items():
        if module.startswith(BELOW_THE_SWEEP) and module != "moebench.run.sweep":
            assert "moebench.run.sweep" not in targets, f"{module} imports moebench.run.sweep (take Params from moebench.params)"


def test_point_data_is_imported_from_params():
    """Params, Timing and Point have one home: nobody (package, tests, scripts) takes them from moebench.run.sweep."""
    moved = {"Params", "Timing", "Point", "_LATER_DEFAULTS"}
    repo = ROOT.parent
    for path in sorted([*ROOT.rglob("*.py"), *(repo / "tests").rglob("*.py"), *(repo / "scripts").rglob("*.py")]):
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "moebench.run.sweep":
                bad = sorted(moved & {a.name for a in node.names})
                assert not bad, f"{path.relative_to(repo)}:{node.lineno} imports {bad} from moebench.run.sweep"


def _details_imports(path: Path, module: str) -> list[int]:
    """Line numbers of the imports of moebench.kernels._details (or a module of it) in the file of `module`."""
    lines = []
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named = [a.name for a in node.names]
        else:
            base = _base(module, path.name == "__init__.py", node)
            named = [base, *(f"{base}.{a.name}" for a in node.names)]
        if any(n == "moebench.kernels._details" or n.startswith("moebench.kernels._details.") for n in named):
            lines.append(node.lineno)
    return lines


def test_kernels_details_are_imported_only_inside_kernels(tmp_path):
    """kernels/_details is private to the library: the rest of moebench, scripts/ and the tests outside tests/kernels
    take what they use from its public faces, moebench.kernels.runtime and moebench.kernels.contract."""
    repo = ROOT.parent
    outside = [(m, p) for m, p in module_files().items() if not m.startswith("moebench.kernels")]
    outside += [(p.stem, p) for sub in ("tests", "scripts") for p in sorted((repo / sub).rglob("*.py"))
                if not p.is_relative_to(repo / "tests" / "kernels")]
    bad = [f"{p.relative_to(repo)}:{line}" for m, p in outside for line in _details_imports(p, m)]
    assert bad == [], "import moebench.kernels.runtime / contract instead of kernels._details"
    # the check sees each spelling of such an import
    probe = tmp_path / "probe.py"
    probe.write_text("import moebench.kernels._details.jit\nfrom moebench.kernels import _details\n"
                     "from moebench.kernels._details.args import check_mask\nfrom moebench.kernels import runtime\n")
    assert _details_imports(probe, "probe") == [1, 2, 3]


def test_reports_and_plots_read_runs_through_records_not_the_runner():
    """moebench.records (the run directory's format) sits at the bottom: report/ and plots/ read runs through it and
    import nothing of moebench.run; the runner leaves the plots to the command line and imports nothing of plots/."""
    graph = import_graph()
    assert graph["moebench.records"] == set()
    for module, targets in graph.items():
        if module.startswith(("moebench.report", "moebench.plots")):
            bad = sorted(t for t in targets if t == "moebench.run" or t.startswith("moebench.run."))
            assert not bad, f"{module} imports {bad} (read runs through moebench.records)"
        if module.startswith("moebench.run"):
            bad = sorted(t for t in targets if t == "moebench.plots" or t.startswith("moebench.plots."))
            assert not bad, f"{module} imports {bad} (the command line makes the plots)"


def test_no_module_is_over_500_lines():
    """A module does one job: every module of the package stays at 500 lines or under (split it by job)."""
    long = {m: n for m, p in module_files().items() if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}, f"modules over 500 lines: {long}"


def test_reports_and_plots_read_the_serving_trace_through_its_typed_record():
    """report/ and plots/ take nothing of bench/ but the serving trace's typed record and its knob group's derived
    keys: every figure they show is read through record.py and trace_record.py, never by reaching into the family's
    other modules."""
    allowed = {"moebench.bench", "moebench.bench.serving_trace", "moebench.bench.serving_trace.record",
               "moebench.bench.serving_trace.trace_record", "moebench.bench.serving_trace.knobs"}
    for module, targets in import_graph().items():
        if module.startswith(("moebench.report", "moebench.plots")):
            bad = sorted(t for t in targets if t.startswith("moebench.bench") and t not in allowed)
            assert not bad, f"{module} imports {bad} (read a serving_trace record through its typed record)"
