"""The package's shape: no import cycles among its modules, and no module reaching
into another's private names (a leading underscore is a promise that nobody outside
depends on the name, so it can change freely)."""

import ast
import collections
import io
import sys
from pathlib import Path

from pyflakes.api import check
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict:
    out = {}
    for path in (ROOT / "rewrite").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict) -> list:
    """(imported module, names) of every import in the file, top level or not."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
            out += [(s, ()) for s in subs]
            names = tuple(a.name for a in node.names if f"{node.module}.{a.name}" not in modules)
            if names:
                out.append((node.module, names))
        elif isinstance(node, ast.Import):
            out += [(a.name, ()) for a in node.names]
    return out


def _cycles(edges: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_among_project_modules():
    modules = _modules()
    edges = collections.defaultdict(set)
    for name, path in modules.items():
        for target, _ in _imports(path, modules):
            if target in modules and target != name:
                edges[name].add(target)
    for name in modules:
        edges[name]
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    edges = collections.defaultdict(set, {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert _cycles(edges) == [["a", "b", "c"]]


def test_no_private_names_imported_across_modules():
    modules = _modules()
    files = list(modules.values()) + sorted((ROOT / "tests").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    offenders = []
    for path in files:
        for target, names in _imports(path, modules):
            if target.startswith("rewrite"):
                private = [n for n in names if n.startswith("_") and not n.startswith("__")]
                offenders += [f"{path.relative_to(ROOT)}: {target}.{n}" for n in private]
                if any(part.startswith("_") and not part.startswith("__") for part in target.split(".")):
                    offenders.append(f"{path.relative_to(ROOT)}: {target}")
    assert offenders == []


def test_short_module_names_are_the_modules_themselves():
    """``rewrite.quant`` and the other short names give the module object of the package
    it lives in (one copy of its state), also as an attribute of ``rewrite``."""
    import importlib

    import rewrite

    for short, real in rewrite.MODULE_ALIASES.items():
        assert importlib.import_module(short) is importlib.import_module(real), short
    assert rewrite.quant is importlib.import_module("rewrite.flows.quant")


def test_no_undefined_names_in_the_library():
    """A name used but never bound fails only when its line runs; a refactor that renames
    a helper and misses a caller on a rare path (a training-mode batch norm, a rule with
    a family-named generator) would ship. pyflakes reads every module without running it."""
    out = io.StringIO()
    for path in sorted((ROOT / "rewrite").rglob("*.py")):
        check(path.read_text(), str(path), Reporter(out, out))
    undefined = [line for line in out.getvalue().splitlines() if "undefined name" in line]
    assert not undefined, "\n".join(undefined)


def test_the_undefined_name_check_sees_one():
    out = io.StringIO()
    check("def f(n):\n    return _argument(n)\n", "x.py", Reporter(out, out))
    assert "undefined name '_argument'" in out.getvalue()
