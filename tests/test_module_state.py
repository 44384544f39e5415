"""Modules whose state moved to its owner hold no module-level mutable state (issue #30).

The RNG tracker is the model's (passed in as ``rng_tracker=``), the checkpoint code takes its
groups, and so on: a module global that is a container or an object of a class would bring back
the singleton.  This test imports each listed module and looks at every global it defines; constants
(numbers, strings, tuples, frozensets), functions, classes, modules, loggers and typing objects pass,
anything else (a dict, list or set, an instance, a lock guarding one) fails, naming it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import threading
import types
import typing

import pytest

# Modules that once held a singleton or looked the layout up, and must not again.
STATELESS = [
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
