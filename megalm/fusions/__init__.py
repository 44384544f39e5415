"""Fused kernels with eager fallbacks, and the choice of backend per piece (see ``backends``)."""

from megalm.fusions.backends import EAGER, BackendUnavailable, FusionPlan, plan_fusions
from megalm.fusions.compile import CompileStats, Fusion, select
from megalm.fusions.registry import FUSIONS, compile_stats

__all__ = [
    "EAGER",
    "FUSIONS",
    "BackendUnavailable",
    "CompileStats",
    "Fusion",
    "FusionPlan",
    "compile_stats",
    "plan_fusions",
    "select",
]
