"""Rotary embedding applied to queries and keys in one fused pass.

:func:`apply_rotary` is the reference (Megatron/Llama "rotate half" form, tables from
:class:`megalm.transformer.rope.RotaryEmbedding`); :func:`rotary_qk` applies it to ``q`` and
``k`` together:
``x_rot = x * cos + rotate_half(x) * sin`` on the first ``rot`` channels, the rest passed
through.  Eagerly that is a slice, a negation, two concatenations and three products per
tensor, each a full pass; compiled it is one pass per tensor forward and backward.
"""

from __future__ import annotations

from typing import Tuple

import torch

from megalm.fusions.compile import fusion


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rot`` channels of ``x`` ``[s, b, heads, d]``; tables from :meth:`RotaryEmbedding.tables`."""
    rot = cos.shape[-1]
    rotated, passed = x[..., :rot], x[..., rot:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return rotated if passed.shape[-1] == 0 else torch.cat([rotated, passed], dim=-1)


@fusion("rope")
def rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(apply_rotary(q), apply_rotary(k))`` with tables ``[s, b or 1, 1, rot]``."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
