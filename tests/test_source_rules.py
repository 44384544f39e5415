"""Static rules over megalm's source, read with ``ast`` (nothing is imported):

* no ``SystemExit`` and no ``sys.exit`` inside ``megalm/``: library code raises a
  :class:`megalm.errors.MegalmError`; only entry points turn errors into exit codes;
* no import cycle between megalm modules through module-level imports (an import inside a
  function runs lazily and is allowed; so is one under ``if TYPE_CHECKING:``);
* ``tools/`` scripts add nothing to ``sys.path``: they are shims over the installed package's
  commands (:mod:`megalm.cli`).
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List, Set

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megalm")


def _modules() -> Dict[str, str]:
    """``{dotted module name: path}`` for every ``.py`` file under ``megalm/``."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


MODULES = _modules()


def _tree(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def exit_calls(tree: ast.AST) -> List[int]:
    """Line numbers that name ``SystemExit`` or call ``sys.exit`` / ``exit`` / ``quit``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "SystemExit":
            lines.append(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "exit"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "exit" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exit", "quit"):
            lines.append(node.lineno)
    return sorted(lines)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: List[ast.stmt]):
    """Import statements run when the module is imported (not inside functions)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _module_level_imports(block)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _module_level_imports(node.body)


def imported_modules(module: str, path: str, known: Set[str]) -> Set[str]:
    """The megalm modules ``module`` imports at module level (``from pkg import sub`` names the
    submodule when ``sub`` is one, else the package), with the packages each of them runs first."""
    is_package = path.endswith("__init__.py")
    out = set()
    for node in _module_level_imports(_tree(path).body):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
            continue
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in known:
                out.add(sub)
            elif base in known:
                out.add(base)
    # Importing a.b.c first runs the packages a and a.b (other than the importer's own packages).
    for name in list(out):
        parts = name.split(".")
        out.update(
            p
            for p in (".".join(parts[:i]) for i in range(1, len(parts)))
            if p in known and not module.startswith(p + ".")
        )
    out.discard(module)
    return out


def import_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (``a -> b -> ... -> a``) per strongly connected component of more than one module."""
    index, low, stack, on_stack, sccs = {}, {}, [], set(), []

    def visit(v):  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(set(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, scc) for scc in sccs]


def _cycle_in(graph: Dict[str, Set[str]], scc: Set[str]) -> List[str]:
    """A shortest cycle through the first module of ``scc`` (breadth-first back to it)."""
    start = min(scc)
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & scc):
                if w == start:
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {scc}")


def test_no_system_exit_in_library_code():
    offenders = {
        f"{os.path.relpath(path, os.path.dirname(ROOT))}:{line}"
        for name, path in MODULES.items()
        for line in exit_calls(_tree(path))
    }
    assert not offenders, "megalm/ must raise a MegalmError, not exit: " + ", ".join(sorted(offenders))


def test_no_import_cycle():
    known = set(MODULES)
    graph = {m: imported_modules(m, p, known) for m, p in MODULES.items()}
    assert "megalm.config.sections" in graph["megalm.config.cli"]  # the graph is really built
    cycles = import_cycles(graph)
    assert not cycles, "module-level import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "source, lines",
    [
        ("import sys\nsys.exit(1)\n", [2]),
        ("def f():\n    raise SystemExit(2)\n", [2]),
        ("try:\n    pass\nexcept SystemExit:\n    pass\n", [3]),
        ("from sys import exit\n", [1]),
        ("exit()\n", [1]),
        ("import sys\nprint(sys.argv)\n", []),
    ],
)
def test_exit_scan_finds_exits(source, lines):
    assert exit_calls(ast.parse(source)) == lines


def test_cycle_finder_reports_the_cycle_and_ignores_lazy_imports(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c", "a"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import x\n")
    (pkg / "x.py").write_text(
        "from pkg.y import f\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.z\n"
    )
    (pkg / "y.py").write_text("def f():\n    from pkg import x\n")
    (pkg / "z.py").write_text("import pkg.x\n")
    (tmp_path / "other.py").write_text("import pkg.y\n")  # runs the package pkg, then pkg.y
    known = {"pkg", "pkg.x", "pkg.y", "pkg.z", "other"}
    assert imported_modules("other", str(tmp_path / "other.py"), known) == {"pkg", "pkg.y"}
    assert imported_modules("pkg", str(pkg / "__init__.py"), known) == {"pkg.x"}
    assert imported_modules("pkg.x", str(pkg / "x.py"), known) == {"pkg.y"}
    assert imported_modules("pkg.y", str(pkg / "y.py"), known) == set()
    assert imported_modules("pkg.z", str(pkg / "z.py"), known) == {"pkg.x"}


TOOLS = os.path.join(os.path.dirname(ROOT), "tools")


def _path_inserts(tree: ast.Module) -> List[int]:
    """Lines of ``sys.path.insert(...)`` / ``sys.path.append(...)`` calls anywhere in ``tree``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append")
    ]


def test_tools_add_nothing_to_sys_path():
    """The tools are thin shims over the installed package (megalm/cli/): none adds a path (the repo
    root) to sys.path; each one's ``main`` is the console script's."""
    from megalm.cli import COMMANDS

    inserts = {}
    for folder, _, files in os.walk(TOOLS):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                lines = _path_inserts(_tree(path))
                if lines:
                    inserts[os.path.relpath(path, TOOLS)] = lines
    assert inserts == {}
    targets = {target.split(":")[0] for target in COMMANDS.values()}
    for folder, _, files in os.walk(TOOLS):
        for name in files:
            if name.endswith(".py"):
                imported = {
                    n.module
                    for n in ast.walk(_tree(os.path.join(folder, name)))
                    if isinstance(n, ast.ImportFrom) and any(a.name == "main" for a in n.names)
                }
                assert imported and imported <= targets, (name, imported)


def test_path_insert_scan_finds_inserts():
    tree = ast.parse("import sys\nsys.path.insert(0, 'x')\nif 'x' not in sys.path:\n    sys.path.append('x')\n")
    assert _path_inserts(tree) == [2, 4]
