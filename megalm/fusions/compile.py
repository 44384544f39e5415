"""``torch.compile`` for megalm's elementwise fusions, with the eager function as fallback.

Each fusion is a plain PyTorch function (its own reference) wrapped in :class:`Fusion`.
When enabled, the first call compiles it with inductor (``dynamic=False``: training shapes
are fixed, so one graph per shape and no recompiles across microbatches); inductor's
on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, default under the system temp dir) makes
later processes reuse the generated kernels.  If compilation fails (no C++ compiler, an
unsupported op) the fusion logs a warning once (on every rank that hits it) and runs eagerly
from then on, with the same numbers up to rounding.

Compilation is paid on the first call per input signature; each :class:`Fusion` counts such
calls and the seconds they took (its :attr:`Fusion.stats`, next to the cache of signatures it
has compiled), and :func:`megalm.fusions.registry.compile_stats` sums them over megalm's fusions
for the trainer's log line.  A fusion object is a per-process compile cache, as torch.compile's
own: the one piece of run-time state that lives in a module (tests/test_module_state.py lists it).

A fusion made with ``dynamic=True`` (the MoE experts' activation, whose token counts change
every step) compiles one graph with symbolic sizes instead; it recompiles only where dynamo
specializes, for a dimension of size 0 or 1, so a handful of graphs in all.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

from megalm.log import get_logger

logger = get_logger(__name__)


@dataclass
class CompileStats:
    graphs: int = 0  # first calls of a fusion on a new input signature
    seconds: float = 0.0  # wall time of those calls (compilation + one run)


def _signature(args, dynamic: bool) -> Tuple:
    """What selects a compiled graph: shapes (with ``dynamic``, only which sizes are 0, 1 or more),
    dtypes, whether autograd records (the tensors' flags and the grad mode: evaluation runs under
    ``no_grad``), devices, and the non-tensor arguments."""

    def shape(t: torch.Tensor) -> Tuple[int, ...]:
        return tuple(min(d, 2) for d in t.shape) if dynamic else tuple(t.shape)

    return (torch.is_grad_enabled(),) + tuple(
        (shape(a), a.dtype, a.requires_grad, a.device.type) if isinstance(a, torch.Tensor) else a for a in args
    )


class Fusion:
    """Callable running ``fn`` compiled (when ``enabled``) or eagerly.

    ``fusion(*args)`` uses the compiled version; ``fusion.eager(*args)`` is the reference.
    Non-tensor arguments must be hashable constants (they specialize the compiled graph).
    ``dynamic``: compile for changing sizes (see the module docstring).
    """

    def __init__(self, fn: Callable, name: str, dynamic: bool = False):
        self.eager = fn
        self.name = name
        self.dynamic = dynamic
        self._compiled = None
        self._failed = False
        self._seen: Dict[Tuple, bool] = {}
        self._lock = threading.Lock()
        self._stats = CompileStats()
        self.__doc__ = fn.__doc__

    @property
    def stats(self) -> CompileStats:
        """This fusion's compilations so far (a copy)."""
        with self._lock:
            return CompileStats(self._stats.graphs, self._stats.seconds)

    def _compiled_fn(self):
        if self._compiled is None:
            self._compiled = torch.compile(self.eager, dynamic=self.dynamic, fullgraph=True)
        return self._compiled

    def __call__(self, *args):
        if self._failed:
            return self.eager(*args)
        key = _signature(args, self.dynamic)
        seen = key in self._seen
        start = time.perf_counter()
        try:  # a seen signature can still recompile (a guard outside the key: strides, ...) and fail
            out = self._compiled_fn()(*args)
        except Exception as err:  # noqa: BLE001 - any compiler failure falls back to eager
            self._failed = True
            reason = f"{type(err).__name__}: {err}".strip().splitlines()[0]  # inductor's errors run long
            logger.warning(f"megalm fusion {self.name!r}: torch.compile failed ({reason}); running it eagerly")
            return self.eager(*args)
        if not seen:
            with self._lock:
                self._seen[key] = True
                self._stats.graphs += 1
                self._stats.seconds += time.perf_counter() - start
        return out


def fusion(name: str, dynamic: bool = False) -> Callable[[Callable], Fusion]:
    """Decorator: ``@fusion("bias_swiglu") def bias_swiglu(...)`` makes a :class:`Fusion`."""
    return lambda fn: Fusion(fn, name, dynamic)


def select(fused: Fusion, enabled: bool) -> Callable:
    """The compiled fusion when ``enabled``, else its eager reference."""
    return fused if enabled else fused.eager
