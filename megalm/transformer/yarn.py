"""YaRN rotary frequency scaling (``--rope-type yarn``), as Megatron-LM's ``YarnRotaryEmbedding``
and Hugging Face's ``rope_type: yarn`` compute it.

For rotary dimension ``dim`` with plain frequencies ``f_i = base^(-2i/dim)`` (``i < dim/2``),
extension ``factor`` and a model trained on ``L = original_max_position_embeddings`` positions:

    low, high = floor(c(beta_fast)), ceil(c(beta_slow)),  clamped to [0, dim - 1]
        where c(r) = dim * ln(L / (2 pi r)) / (2 ln base)   (the index that rotates r times over L)
    ramp_i    = clamp((i - low) / (high - low), 0, 1)
    inv_freq_i = f_i / factor * ramp_i + f_i * (1 - ramp_i)

(fast-rotating dims keep their frequency, slow ones are interpolated).  The cos/sin tables are
multiplied by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the softmax scale by
``mscale(factor, mscale_all_dim)^2``, with ``mscale(s, m) = 1 if s <= 1 else 0.1 m ln s + 1``.
``factor == 1`` is plain RoPE.  No parameters, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """``0.1 mscale ln(scale) + 1`` (1 when ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """The YaRN settings (Megatron's ``--rotary-scaling-factor``, ``--original-max-position-embeddings``,
    ``--beta-fast``, ``--beta-slow``, ``--mscale``, ``--mscale-all-dim``)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True  # Megatron's --[no-]yarn-correction-range-round-to-int (HF's "truncate")

    @classmethod
    def from_model_config(cls, m) -> "YarnScaling":
        return cls(
            factor=float(m.rotary_scaling_factor),
            original_max_position_embeddings=int(m.original_max_position_embeddings or 4096),
            beta_fast=float(m.beta_fast),
            beta_slow=float(m.beta_slow),
            mscale=float(m.mscale),
            mscale_all_dim=float(m.mscale_all_dim),
            round_to_int=getattr(m, "yarn_correction_range_round_to_int", None) is not False,
        )

    def _correction_dim(self, rotations: float, dim: int, base: float) -> float:
        return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    def inv_freq(self, dim: int, base: float, device=None) -> torch.Tensor:
        """The ``dim/2`` scaled inverse frequencies (fp32)."""
        exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
        extrapolated = 1.0 / (base**exponent)
        interpolated = 1.0 / (self.factor * base**exponent)
        low, high = self._correction_dim(self.beta_fast, dim, base), self._correction_dim(self.beta_slow, dim, base)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no division by zero
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep = 1.0 - ramp  # 1: extrapolated (fast dims), 0: interpolated
        return interpolated * (1 - keep) + extrapolated * keep

    @property
    def table_scale(self) -> float:
        """Factor on the cos/sin tables."""
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_scale_factor(self) -> float:
        """Factor on the attention's ``1/sqrt(d)`` softmax scale."""
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2
