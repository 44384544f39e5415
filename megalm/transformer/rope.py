"""Rotary position embedding (RoPE), Megatron/Llama non-interleaved "rotate half" form.

With ``rot = head_dim * rotary_percent`` rotated dimensions and
``inv_freq[i] = base^(-2i/rot)`` for ``i < rot/2``, position ``p`` uses angles
``theta = p * [inv_freq, inv_freq]`` and
``x_rot = x * cos(theta) + rotate_half(x) * sin(theta)``, ``rotate_half([x1, x2]) = [-x2, x1]``;
the remaining ``head_dim - rot`` dimensions pass through (:func:`apply_rotary`, which lives
with its fused form in :mod:`megalm.fusions.rope`).  With ``yarn`` (``--rope-type yarn``) the
frequencies and the tables' scale are YaRN's (:mod:`megalm.transformer.yarn`).  No communication.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megalm.fusions.rope import apply_rotary
from megalm.transformer.yarn import YarnScaling

__all__ = ["RotaryEmbedding", "apply_rotary", "rotary_embedding"]


class RotaryEmbedding:
    """Computes the ``cos``/``sin`` tables for given positions (no parameters, no state)."""

    def __init__(
        self, head_dim: int, rotary_percent: float = 1.0, base: float = 10000.0, yarn: Optional[YarnScaling] = None
    ):
        self.rotary_dim = int(head_dim * rotary_percent)
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary dimension {self.rotary_dim} must be a positive even number")
        self.base = float(base)
        self.yarn = yarn

    def inv_freq(self, device) -> torch.Tensor:
        if self.yarn is not None:
            return self.yarn.inv_freq(self.rotary_dim, self.base, device)
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
        scale = 1.0 if self.yarn is None else self.yarn.table_scale
        if scale != 1.0:
            return angles.cos() * scale, angles.sin() * scale
        return angles.cos(), angles.sin()


def rotary_embedding(m) -> Optional[RotaryEmbedding]:
    """The model's rotary tables (None without ``--position-embedding-type rope``): over ``head_dim x
    --rotary-percent``, or ``--qk-pos-emb-head-dim`` with multi-latent attention; YaRN with
    ``--rope-type yarn`` (the default under ``--multi-latent-attention``, as Megatron's MLA config)."""
    if m.position_embedding_type != "rope":
        return None
    yarn = YarnScaling.from_model_config(m) if m.rope_type == "yarn" else None
    if m.multi_latent_attention:
        return RotaryEmbedding(m.qk_pos_emb_head_dim, 1.0, m.rotary_base, yarn)
    return RotaryEmbedding(m.head_dim, m.rotary_percent, m.rotary_base, yarn)
