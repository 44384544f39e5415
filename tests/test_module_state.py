"""Module-level mutable state stays with its owner (issue #30).

Two checks.  (1) Every module of megalm/ is parsed and every function in it searched for a change to
one of the module's own globals (``global X``, ``X[k] = ...``, ``X.attr = ...``, ``X.append(...)`` and
the other container mutators); only :data:`RUNTIME_STATE_ALLOWED` may be changed, each for its reason.
(2) The modules that once held a singleton (the RNG tracker, the collective statistics, ...) are imported
and every global they define is looked at: constants (numbers, strings, tuples, frozensets), functions,
classes, modules, loggers and typing objects pass, anything else (a dict, list or set, an instance, a lock
guarding one) fails, naming it.  The collective statistics are the Trainer's
:class:`megalm.distributed.comm.CommStats`; each fusion counts its own compilations
(:mod:`megalm.fusions.registry`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import pathlib
import threading
import types
import typing

import pytest

MEGALM = pathlib.Path(__file__).resolve().parent.parent / "megalm"

# The module globals a function may change (path relative to megalm/ : name), with the reason.
RUNTIME_STATE_ALLOWED = {
    "data/helpers.py:_LIB": "the compiled C++ index helpers, loaded lazily once per process (a library handle)",
    "data/preprocess.py:_WORKER": "what a tokenizing pool worker's initializer built, in that worker process only",
    "parallel_state.py:_STATE": "Megatron's parallel_state getters, for users and tools; megalm below the entry "
    "points takes its ProcessGroups",
}

MUTATORS = frozenset(
    "append extend insert update setdefault pop popitem clear add discard remove sort reverse "
    "__setitem__ __delitem__".split()
)


def _module_names(tree: ast.Module) -> set:
    names = set()
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def _root(node) -> str:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def mutated_globals(source: str) -> list:
    """``(name, how)`` for each module global of ``source`` that one of its functions changes (a name the
    function binds itself, a parameter or local, is not the global)."""
    tree = ast.parse(source)
    names, found = _module_names(tree), set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        declared = {g for n in ast.walk(fn) if isinstance(n, ast.Global) for g in n.names}
        a = fn.args
        local = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None}
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        local -= declared
        found |= {(g, "global") for g in declared & names}
        for node in ast.walk(fn):
            targets = getattr(node, "targets", None) or (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            )
            for target in targets:
                if isinstance(target, (ast.Subscript, ast.Attribute)) and _root(target) in names - local:
                    found.add((_root(target), "store"))
            call = node.func if isinstance(node, ast.Call) else None
            if isinstance(call, ast.Attribute) and call.attr in MUTATORS and _root(call.value) in names - local:
                found.add((_root(call.value), f".{call.attr}()"))
    return sorted(found)


def test_no_module_global_is_changed_at_run_time():
    changed = {}
    for path in sorted(MEGALM.rglob("*.py")):
        for name, how in mutated_globals(path.read_text()):
            changed.setdefault(f"{path.relative_to(MEGALM).as_posix()}:{name}", []).append(how)
    assert sorted(changed) == sorted(RUNTIME_STATE_ALLOWED), {
        k: v for k, v in changed.items() if k not in RUNTIME_STATE_ALLOWED
    }


def test_the_mutation_scan_finds_each_kind_of_change():
    source = """
_STATS = {}
_LOCK = threading.Lock()
_HANDLE = None
_BARRIER = [None]
TABLE = {"a": 1}
_TRACKER = Tracker()

def record(kind):
    with _LOCK:
        _STATS.setdefault(kind, 0)

def load():
    global _HANDLE
    _HANDLE = 1

def arm(fn):
    _BARRIER[0] = fn

def seed(n):
    _TRACKER.seed = n

def reads(TABLE=TABLE):
    TABLE.update(b=2)  # the parameter, not the global
    return dict(TABLE)
"""
    assert mutated_globals(source) == [
        ("_BARRIER", "store"),
        ("_HANDLE", "global"),
        ("_STATS", ".setdefault()"),
        ("_TRACKER", "store"),
    ]


def test_every_fusion_is_registered():
    """A :class:`~megalm.fusions.compile.Fusion` is the one kind of per-process cache a module may hold (as
    torch.compile's own); each is in ``FUSIONS``, so the trainer's compile counts see all of them."""
    import pkgutil

    import megalm.fusions
    from megalm.fusions import FUSIONS, Fusion

    found = set()
    for info in pkgutil.iter_modules(megalm.fusions.__path__, "megalm.fusions."):
        found |= {id(v) for v in vars(importlib.import_module(info.name)).values() if isinstance(v, Fusion)}
    assert found == {id(f) for f in FUSIONS} and len(FUSIONS) == len(set(map(id, FUSIONS)))


# Modules that once held a singleton or looked the layout up, and must not again.
STATELESS = [
    "megalm.distributed.comm",
    "megalm.fusions.compile",
    "megalm.planner.calibrate",
    "megalm.tensor_parallel.random",
    "megalm.checkpoint.rng",
    "megalm.checkpoint.save",
    "megalm.checkpoint.load",
    "megalm.checkpoint.common_json",
    "megalm.checkpoint.model_state",
    "megalm.transformer.attention",
    "megalm.transformer.transformer_layer",
    "megalm.transformer.transformer_block",
    "megalm.models.gpt",
    "megalm.models.embedding",
]

CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, tuple, frozenset, range)
OTHER_ALLOWED = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    type,
    logging.Logger,
    logging.LoggerAdapter,
    typing.TypeVar,
)
LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


def assigned_names(module) -> list:
    """The names ``module`` assigns at its top level (``X = ...``, ``X: T = ...``), in order; imports and
    definitions are left out (an imported object is its own module's state)."""
    source = getattr(module, "__source__", None) or inspect.getsource(module)
    names = []
    for node in ast.parse(source).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


def mutable_globals(module) -> list:
    """Names of ``module``'s own globals that are mutable state (see the module docstring)."""
    found = []
    for name in assigned_names(module):
        value = vars(module)[name]
        if name.startswith("__") and name.endswith("__"):
            continue
        if isinstance(value, CONSTANT_TYPES) or isinstance(value, OTHER_ALLOWED):
            continue
        if getattr(value, "__module__", None) in ("typing", "typing_extensions"):  # Dict[str, int], Optional[...]
            continue
        if isinstance(value, LOCK_TYPES) or isinstance(value, (dict, list, set, bytearray)) or not callable(value):
            found.append(f"{module.__name__}.{name} ({type(value).__name__})")
        elif not isinstance(value, (types.MethodType, types.BuiltinMethodType)) and not hasattr(value, "__wrapped__"):
            found.append(f"{module.__name__}.{name} ({type(value).__name__})")  # a callable object: it holds state
    return found


@pytest.mark.parametrize("name", STATELESS)
def test_module_holds_no_mutable_state(name):
    assert mutable_globals(importlib.import_module(name)) == []


def test_the_scan_finds_a_singleton():
    """The check can fail: a module with a tracker singleton, a registry dict and a lock is reported."""
    from megalm.tensor_parallel.random import RNGStatesTracker

    fake = types.ModuleType("fake_random")
    fake.__source__ = """
MODEL_PARALLEL_RNG, OFFSETS = "model-parallel-rng", (2718, 1024)
_TRACKER = RNGStatesTracker()
_STATS: dict = {}
_LOCK = threading.Lock()
"""
    fake.RNGStatesTracker, fake.threading = RNGStatesTracker, threading  # imported: not checked
    exec(fake.__source__, vars(fake))
    assert mutable_globals(fake) == [
        "fake_random._TRACKER (RNGStatesTracker)",
        "fake_random._STATS (dict)",
        "fake_random._LOCK (lock)",
    ]
