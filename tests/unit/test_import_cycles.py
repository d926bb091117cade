"""No import cycles between packages (issue 35: "a layout that shows the concepts").

Every ``.py`` under the project's packages is parsed (never imported) and every import is collected: at module level
and inside functions (an import inside a function is a dependency all the same; putting it there only hides a cycle
from Python's loader), and imports by name (``importlib.import_module("search.x")``, ``__import__("search.x")``
with a literal name: a string hides the dependency from a reader, not from this test). Each module belongs to a package node:

- a module belongs to the innermost package directory holding it (``search/spec/model.py`` -> ``search.spec``); a
  package's ``__init__.py`` is the package itself;
- so a module loose at a package root counts as that package (``aceso_megatron/preflight.py`` -> ``aceso_megatron``):
  a root whose loose modules import its subpackages must not be imported by them;
- ``__main__.py`` is an entry point, its own node (``search.__main__``): nothing imports it.

An import names the module it loads: ``from P import x`` is ``P.x`` when that is a module, else ``P``;
``import a.b.c`` is the longest prefix that is a module. Implicit imports of parent packages do not count.

Module-level imports must form no cycle, and function-level imports none either (the allow-list the layout work
started with, 11 arcs, is gone: each was broken at its root).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("search", "aceso_megatron", "patches", "model_specs", "launch")

def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    out = {}
    for top in PACKAGES:
        for f in sorted((root / top).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


def package_of(mod: str, mods: dict[str, tuple[Path, bool]]) -> str:
    if mods[mod][1] or mod.endswith(".__main__"):
        return mod
    return mod.rpartition(".")[0]


def imports(mod: str, mods: dict[str, tuple[Path, bool]]):
    """(imported module, line, inside a function) for every import of ``mod`` that names a project module."""
    path, is_pkg = mods[mod]
    tree = ast.parse(path.read_text(), str(path))
    base = mod if is_pkg else mod.rpartition(".")[0]
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(fn) if n is not fn)

    def longest(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [longest(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = node.module or ""
            if node.level:
                parts = base.split(".")
                src = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else longest(src) for a in node.names]
        elif isinstance(node, ast.Call) and _dynamic(node) is not None:
            targets = [longest(_dynamic(node))]     # an import by name is an import all the same
        else:
            continue
        for t in targets:
            if t and t != mod:
                yield t, node.lineno, id(node) in in_function


def _dynamic(call: ast.Call) -> str | None:
    """The module a literal ``importlib.import_module("a.b")`` or ``__import__("a.b")`` loads, else None."""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def package_edges(root: Path = ROOT) -> dict[tuple[str, str], list[tuple[str, int, str, bool]]]:
    """(from package, to package) -> [(module, line, imported module, inside a function)]."""
    mods = modules(root)
    edges = defaultdict(list)
    for m in mods:
        for t, line, in_fn in imports(m, mods):
            a, b = package_of(m, mods), package_of(t, mods)
            if a != b:
                edges[(a, b)].append((m, line, t, in_fn))
    return edges


def cycles(arcs) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan), each sorted."""
    adj = defaultdict(set)
    for a, b in arcs:
        adj[a].add(b)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(adj[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while comp[-1:] != [v]:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(adj) | {b for bs in adj.values() for b in bs}):
        if v not in index:
            visit(v)
    return out


def report(comps, edges) -> str:
    """Each cycle with one example import per arc inside it."""
    lines = []
    for comp in comps:
        lines.append("cycle: " + ", ".join(comp))
        for (a, b), ev in sorted(edges.items()):
            if a in comp and b in comp:
                m, line, t, in_fn = ev[0]
                lines.append(f"  {a} -> {b}: {m} line {line} imports {t}"
                             f"{' (inside a function)' if in_fn else ''} ({len(ev)} import(s))")
    return "\n".join(lines)


def module_level(edges):
    return {k: [e for e in v if not e[3]] for k, v in edges.items() if any(not e[3] for e in v)}


@pytest.fixture(scope="module")
def repo_edges():
    """The checkout's package edges, walked once for both cycle tests (neither changes them)."""
    return package_edges()


def test_no_package_cycle_at_module_level(repo_edges):
    edges = module_level(repo_edges)
    comps = cycles(edges)
    assert not comps, "package import cycles (module-level imports):\n" + report(comps, edges)


def test_no_package_cycle_with_function_imports(repo_edges):
    edges = repo_edges
    comps = cycles(edges)
    assert not comps, "package import cycles (imports inside functions counted):\n" + report(comps, edges)


def test_the_check_sees_cycles(tmp_path):
    """The walk finds a cycle hidden in a function, one through a package root's loose module, and imports by name."""
    for rel, text in {
        "search/__init__.py": "", "search/loose.py": "from search.sub import b\n",
        "search/sub/__init__.py": "", "search/sub/b.py": "def f():\n    from search import loose\n",
        "search/hid/__init__.py": "", "search/hid/c.py": "import importlib\nimportlib.import_module('search.sub.b')\n",
        "search/sub/d.py": "def g():\n    return __import__('search.hid.c')\n",
        "search/__main__.py": "from search.sub import b\n", "search/other/__init__.py": "from ..sub import b\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    for top in PACKAGES[1:]:
        (tmp_path / top).mkdir()
    edges = package_edges(tmp_path)
    assert set(edges) == {("search", "search.sub"), ("search.sub", "search"), ("search.__main__", "search.sub"),
                          ("search.other", "search.sub"), ("search.hid", "search.sub"), ("search.sub", "search.hid")}
    assert edges[("search.sub", "search")] == [("search.sub.b", 2, "search.loose", True)]
    assert edges[("search.sub", "search.hid")] == [("search.sub.d", 2, "search.hid.c", True)]
    assert cycles(module_level(edges)) == []     # the import by name in search.sub.d is inside a function
    assert cycles(edges) == [["search", "search.hid", "search.sub"]]
