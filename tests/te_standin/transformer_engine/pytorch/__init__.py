"""Stand-in for ``transformer_engine.pytorch``: the modules and the fp8 region megalm uses."""

from .attention import DotProductAttention
from .fp8 import fp8_autocast
from .module import LayerNormLinear, Linear

__all__ = ["DotProductAttention", "LayerNormLinear", "Linear", "fp8_autocast"]
