"""Stand-in for ``transformer_engine.common.recipe``: the FP8 formats and the delayed-scaling recipe,
with TE's field names, defaults and checks."""

from dataclasses import dataclass
from enum import Enum
from typing import Callable, NamedTuple, Optional, Union


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    """E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 forward, E5M2 backward)."""

    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


class Recipe:
    """Base class of TE's recipes."""


@dataclass
class DelayedScaling(Recipe):
    """Scaling factors from the amax history of previous steps:
    ``scale = fp8_max / amax / 2 ** margin``, amax = max or most recent of ``amax_history_len`` steps."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        assert self.fp8_format != Format.E5M2, "Pure E5M2 training is not supported."
        assert isinstance(self.margin, int) and self.margin >= 0, self.margin
        assert isinstance(self.amax_history_len, int) and self.amax_history_len >= 1, self.amax_history_len
        assert callable(self.amax_compute_algo) or self.amax_compute_algo in ("max", "most_recent"), (
            self.amax_compute_algo
        )
