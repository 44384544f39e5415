"""Fused kernels with eager fallbacks, and the choice of backend per piece (see ``backends``)."""

from megalm.fusions.backends import EAGER, BackendUnavailable, FusionPlan, plan_fusions
from megalm.fusions.compile import CompileStats, Fusion, compile_stats, select

__all__ = [
    "EAGER",
    "BackendUnavailable",
    "CompileStats",
    "Fusion",
    "FusionPlan",
    "compile_stats",
    "plan_fusions",
    "select",
]
