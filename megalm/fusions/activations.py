"""Bias + activation fusions of the MLP: ``gelu(x + b)`` and ``silu(gate + b_g) * (up + b_u)``.

Without fusion each is two to four elementwise kernels forward and more backward, each a
full pass over the ``[s, b, ffn/tp]`` activation; compiled, each direction is one pass and
autograd saves only the input.  No communication.

The MoE experts use the ``expert_*`` twins, compiled for changing token counts
(``dynamic=True``): each expert's share of the tokens differs from step to step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megalm.fusions.compile import Fusion, fusion


@fusion("bias_gelu")
def bias_gelu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``gelu(x + bias)`` (exact erf GeLU, as ``F.gelu``); ``bias`` may be None."""
    return F.gelu(x if bias is None else x + bias)


@fusion("bias_swiglu")
def bias_swiglu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate ; up] = x + bias`` split in halves on the last dimension."""
    gate, up = torch.chunk(x if bias is None else x + bias, 2, dim=-1)
    return F.silu(gate) * up


expert_bias_gelu = Fusion(bias_gelu.eager, "expert_bias_gelu", dynamic=True)
expert_bias_swiglu = Fusion(bias_swiglu.eager, "expert_bias_swiglu", dynamic=True)
