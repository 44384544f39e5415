"""Every :class:`~megalm.fusions.compile.Fusion` megalm defines, and their compilations summed.

The trainer logs the graphs compiled since its last log line from :func:`compile_stats`; each
fusion keeps its own count (:attr:`~megalm.fusions.compile.Fusion.stats`), so nothing here holds
state: ``FUSIONS`` is a tuple fixed at import.
"""

from __future__ import annotations

from typing import Iterable

from megalm.fusions.activations import (
    bias_gated,
    bias_gelu,
    bias_gelu_tanh,
    bias_squared_relu,
    bias_swiglu,
    expert_bias_gated,
    expert_bias_gelu,
    expert_bias_gelu_tanh,
    expert_bias_squared_relu,
    expert_bias_swiglu,
)
from megalm.fusions.compile import CompileStats, Fusion
from megalm.fusions.dropout_add import bias_dropout_add
from megalm.fusions.norms import layer_norm, rms_norm
from megalm.fusions.rope import rotary_qk
from megalm.fusions.softmax import scaled_causal_softmax

FUSIONS = (
    bias_gelu,
    bias_gelu_tanh,
    bias_squared_relu,
    bias_swiglu,
    bias_gated,
    expert_bias_gelu,
    expert_bias_gelu_tanh,
    expert_bias_squared_relu,
    expert_bias_swiglu,
    expert_bias_gated,
    bias_dropout_add,
    layer_norm,
    rms_norm,
    rotary_qk,
    scaled_causal_softmax,
)


def compile_stats(fusions: Iterable[Fusion] = FUSIONS) -> CompileStats:
    """Graphs compiled and seconds spent by ``fusions`` (default: all of megalm's) in this process so far."""
    total = CompileStats()
    for f in fusions:
        s = f.stats
        total.graphs += s.graphs
        total.seconds += s.seconds
    return total
