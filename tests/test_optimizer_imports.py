"""megalm.optimizer has no import cycle: a static graph of every import statement (module level and
inside functions) between its modules and the checkpointer (megalm.checkpoint.save / load), and each
module imported first in a fresh interpreter."""

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megalm", "optimizer")
CHECKPOINTER = ["megalm.checkpoint.save", "megalm.checkpoint.load"]
MODULES = sorted(f"megalm.optimizer.{f[:-3]}" for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py")


def imported_modules(path):
    """Every ``megalm.*`` module a file imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # "from megalm.optimizer import x"
    return {m for m in out if m.startswith("megalm.")}


def graph():
    nodes = MODULES + CHECKPOINTER
    path = {m: os.path.join(ROOT, *m.split(".")) + ".py" for m in nodes}
    return {m: sorted(imported_modules(path[m]) & set(nodes) - {m}) for m in nodes}


def find_cycle(edges):
    """One cycle as a list of modules, or None (depth-first search)."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in edges[m]:
            if state.get(n) == "open":
                return stack[stack.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = "done"
        stack.pop()
        return None

    for m in edges:
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None


def test_optimizer_modules_import_graph_is_acyclic():
    edges = graph()
    assert "megalm.optimizer.factory" in edges and "megalm.optimizer.distrib_optimizer" in edges
    assert find_cycle(edges) is None, edges
    # the base class knows neither its subclass nor the factory; no optimizer module reads checkpointing
    leaves = {
        "megalm.optimizer.clip_grads",
        "megalm.optimizer.grad_scaler",
        "megalm.optimizer.cpu_offload",
        "megalm.optimizer.tensor_norms",
    }
    assert set(edges["megalm.optimizer.optimizer"]) <= leaves
    assert edges["megalm.optimizer.cpu_offload"] == []
    assert not edges["megalm.optimizer.tensor_norms"]  # a leaf: imports no optimizer module
    assert "megalm.optimizer.factory" not in edges["megalm.optimizer.distrib_optimizer"]
    assert not [m for m in MODULES if set(CHECKPOINTER) & set(edges[m])]


# Imports each module named on the command line first, in a child forked from an interpreter that has
# imported every module of other packages these modules load (torch, ...) and nothing of megalm: as a fresh
# interpreter would, without paying torch's import each time.  Prints {module: [exit code, traceback]}.
FORKED_IMPORTS = """
import importlib, json, os, sys, traceback


def forked(fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            code, text = 0, fn()
        except BaseException:
            code, text = 1, traceback.format_exc()
        os.write(w, text.encode())
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), text]


def megalm_loaded():
    return [m for m in sys.modules if m.split(".")[0] == "megalm"]


def others_loaded():
    for m in sys.argv[1:]:
        importlib.import_module(m)
    return "\\n".join(m for m in sys.modules if m.split(".")[0] not in ("megalm", "__main__"))


code, names = forked(others_loaded)
for name in names.splitlines() if code == 0 else ():
    try:
        importlib.import_module(name)
    except Exception:
        pass
assert not megalm_loaded(), megalm_loaded()
print(json.dumps({m: forked(lambda m=m: importlib.import_module(m) and "") for m in sys.argv[1:]}))
"""


@pytest.fixture(scope="module")
def first_imports():
    """{module: (exit code, traceback)} of importing each module first in a fresh process."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", FORKED_IMPORTS, *MODULES], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_first_in_a_fresh_interpreter(module, first_imports):
    code, text = first_imports[module]
    assert code == 0, text
