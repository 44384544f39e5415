"""Bias + dropout + residual add: ``residual + dropout(x + bias)``, the end of every sublayer.

Eagerly three passes over ``[s, b, h]`` (two without bias); compiled one.  With dropout the
compiled kernel draws its mask from inductor's generator (seeded from the default torch
generator, so forked RNG streams and bit-exact recomputation still hold), which differs
from ``F.dropout``'s mask for the same seed: same distribution, different draws.  No
communication.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megalm.fusions.compile import fusion


@fusion("bias_dropout_add")
def bias_dropout_add(
    x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    out = x if bias is None else x + bias
    if training and p > 0.0:
        out = F.dropout(out, p, True)
    return residual + out
