"""Rotary position embedding (RoPE), Megatron/Llama non-interleaved "rotate half" form.

With ``rot = head_dim * rotary_percent`` rotated dimensions and
``inv_freq[i] = base^(-2i/rot)`` for ``i < rot/2``, position ``p`` uses angles
``theta = p * [inv_freq, inv_freq]`` and
``x_rot = x * cos(theta) + rotate_half(x) * sin(theta)``, ``rotate_half([x1, x2]) = [-x2, x1]``;
the remaining ``head_dim - rot`` dimensions pass through (:func:`apply_rotary`, which lives
with its fused form in :mod:`megalm.fusions.rope`).  No communication.

YaRN (``--position-embedding-type yarn``, Megatron's ``YarnRotaryEmbedding``; arXiv 2309.00071): with
scaling factor ``s``, original context ``L``, ``beta_fast``/``beta_slow``, dimension ``i`` of ``rot/2``
takes ``inv_freq[i] = inv_freq[i] / s * (1 - m_i) + inv_freq[i] * m_i`` where ``m = 1 - ramp(low, high)``
and ``low``/``high`` are the dimensions that turn ``beta_fast``/``beta_slow`` times over ``L`` positions
(``rot ln(L / (2 pi beta)) / (2 ln base)``, rounded outward when ``round_to_int``); cos and sin are
multiplied by ``mscale(s, mscale) / mscale(s, mscale_all_dim)``, ``mscale(s, m) = 0.1 m ln s + 1``
(1 for ``s <= 1``; with ``mscale_all_dim`` 0 the divisor is 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from megalm.fusions.rope import apply_rotary

__all__ = ["RotaryEmbedding", "apply_rotary"]


@dataclass(frozen=True)
class Yarn:
    """YaRN's parameters (Megatron's ``yarn_*`` / ``--rotary-scaling-factor`` / ``--mscale*``)."""

    scaling_factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    round_to_int: bool = True

    @classmethod
    def from_config(cls, m) -> "Yarn":
        return cls(
            m.rotary_scaling_factor,
            m.yarn_original_max_position_embeddings,
            m.yarn_beta_fast,
            m.yarn_beta_slow,
            m.mscale,
            m.mscale_all_dim,
            bool(m.yarn_correction_range_round_to_int),
        )

    def correction_range(self, dim: int, base: float) -> Tuple[float, float]:
        def at(rotations: float) -> float:
            length = self.original_max_position_embeddings
            return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = at(self.beta_fast), at(self.beta_slow)
        if self.round_to_int:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def concentration(self) -> float:
        def mscale(m: float) -> float:
            return 1.0 if self.scaling_factor <= 1 else 0.1 * m * math.log(self.scaling_factor) + 1.0

        return mscale(self.mscale) / mscale(self.mscale_all_dim)

    def inv_freq(self, inv_freq: torch.Tensor, dim: int, base: float) -> torch.Tensor:
        low, high = self.correction_range(dim, base)
        if low == high:
            high += 0.001  # as Megatron / HF: no singular ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1.0 - ramp
        return inv_freq / self.scaling_factor * (1 - extrapolate) + inv_freq * extrapolate


class RotaryEmbedding:
    """Computes the ``cos``/``sin`` tables for given positions (no parameters, no state); ``yarn``: the
    YaRN-scaled frequencies and concentration factor (see the module docstring)."""

    def __init__(self, head_dim: int, rotary_percent: float = 1.0, base: float = 10000.0, yarn: Optional[Yarn] = None):
        self.rotary_dim = int(head_dim * rotary_percent)
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary dimension {self.rotary_dim} must be a positive even number")
        self.base = float(base)
        self.yarn = yarn

    def inv_freq(self, device) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        inv_freq = 1.0 / (self.base**exponent)
        return inv_freq if self.yarn is None else self.yarn.inv_freq(inv_freq, self.rotary_dim, self.base)

    def tables(
        self, position_ids: Optional[torch.Tensor], seq_length: int, device
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of shape ``[s, b or 1, 1, rot]`` in fp32.

        ``position_ids``: ``[b, s]`` or None for ``0..s-1``.
        """
        if position_ids is None:
            positions = torch.arange(seq_length, dtype=torch.float32, device=device).unsqueeze(1)  # [s, 1]
        else:
            positions = position_ids.to(device=device, dtype=torch.float32).t()  # [s, b]
        angles = positions.unsqueeze(-1) * self.inv_freq(device)  # [s, b, rot/2]
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(2)  # [s, b, 1, rot]
        if self.yarn is not None:
            scale = self.yarn.concentration()
            return angles.cos() * scale, angles.sin() * scale
        return angles.cos(), angles.sin()
