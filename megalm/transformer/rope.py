"""Rotary position embedding (RoPE), Megatron/Llama non-interleaved "rotate half" form.

With ``rot = head_dim * rotary_percent`` rotated dimensions and
``inv_freq[i] = base^(-2i/rot)`` for ``i < rot/2``, position ``p`` uses angles
``theta = p * [inv_freq, inv_freq]`` and
``x_rot = x * cos(theta) + rotate_half(x) * sin(theta)``, ``rotate_half([x1, x2]) = [-x2, x1]``;
the remaining ``head_dim - rot`` dimensions pass through (:func:`apply_rotary`, which lives
with its fused form in :mod:`megalm.fusions.rope`).  No communication.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megalm.fusions.rope import apply_rotary

__all__ = ["RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding:
    """Computes the ``cos``/``sin`` tables for given positions (no parameters, no state)."""

    def __init__(self, head_dim: int, rotary_percent: float = 1.0, base: float = 10000.0):
        self.rotary_dim = int(head_dim * rotary_percent)
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary dimension {self.rotary_dim} must be a positive even number")
        self.base = float(base)

    def inv_freq(self, device) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        return 1.0 / (self.base**exponent)

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
        return angles.cos(), angles.sin()
