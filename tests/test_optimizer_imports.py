"""Each megalm.optimizer module imports first in a fresh interpreter (no import-order dependence).

The static import rules (layers, cycles at any depth) are tests/test_layers.py's."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megalm", "optimizer")
MODULES = sorted(f"megalm.optimizer.{f[:-3]}" for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py")


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
