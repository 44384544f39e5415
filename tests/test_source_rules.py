"""Static rules over megalm's source, read with ``ast`` (nothing is imported):

* no ``SystemExit`` and no ``sys.exit`` inside ``megalm/``: library code raises a
  :class:`megalm.errors.MegalmError`; only entry points turn errors into exit codes;
* ``tools/`` scripts add nothing to ``sys.path``: the tools are shims over the installed package's
  commands (:mod:`megalm.cli`).

Imports (the layer map, cycles at any depth) are checked by tests/test_layers.py.
"""

from __future__ import annotations

import ast
import os
from typing import Dict, List

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


def test_no_system_exit_in_library_code():
    offenders = {
        f"{os.path.relpath(path, os.path.dirname(ROOT))}:{line}"
        for name, path in MODULES.items()
        for line in exit_calls(_tree(path))
    }
    assert not offenders, "megalm/ must raise a MegalmError, not exit: " + ", ".join(sorted(offenders))


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
    root) to sys.path (tests/test_cli.py runs each shim)."""
    inserts = {}
    for folder, _, files in os.walk(TOOLS):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                lines = _path_inserts(_tree(path))
                if lines:
                    inserts[os.path.relpath(path, TOOLS)] = lines
    assert inserts == {}


def test_path_insert_scan_finds_inserts():
    tree = ast.parse("import sys\nsys.path.insert(0, 'x')\nif 'x' not in sys.path:\n    sys.path.append('x')\n")
    assert _path_inserts(tree) == [2, 4]
