"""Bias + activation fusions of the MLP: ``gelu(x + b)`` (exact, or tanh with ``--openai-gelu``) and
``silu(gate + b_g) * (up + b_u)``.

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


@fusion("bias_gelu_tanh")
def bias_gelu_tanh(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``gelu(x + bias)`` in the tanh approximation ``0.5 y (1 + tanh(sqrt(2/pi) (y + 0.044715 y^3)))``
    (``--openai-gelu``: Megatron-LM's ``openai_gelu`` and its fused ``bias_gelu``); ``bias`` may be None."""
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


def gelu_fusion(openai_gelu: bool) -> Fusion:
    """The bias + GELU of ``--openai-gelu`` (tanh) or the default (exact erf)."""
    return bias_gelu_tanh if openai_gelu else bias_gelu


@fusion("bias_swiglu")
def bias_swiglu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate ; up] = x + bias`` split in halves on the last dimension."""
    gate, up = torch.chunk(x if bias is None else x + bias, 2, dim=-1)
    return F.silu(gate) * up


expert_bias_gelu = Fusion(bias_gelu.eager, "expert_bias_gelu", dynamic=True)
expert_bias_gelu_tanh = Fusion(bias_gelu_tanh.eager, "expert_bias_gelu_tanh", dynamic=True)
expert_bias_swiglu = Fusion(bias_swiglu.eager, "expert_bias_swiglu", dynamic=True)
