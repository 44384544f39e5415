"""Bias + activation fusions of the MLP: ``gelu(x + b)`` (exact, or tanh with ``--openai-gelu``),
``relu(x + b)^2`` (``--squared-relu``) and ``silu(gate + b_g) * (up + b_u)``.

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


@fusion("bias_squared_relu")
def bias_squared_relu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``relu(x + bias)^2`` (``--squared-relu``: Megatron-LM's ``squared_relu``); ``bias`` may be None.
    Autograd saves the input, as for GELU: the gradient is ``2 relu(y)``."""
    return torch.square(F.relu(x if bias is None else x + bias))


def gelu_fusion(openai_gelu: bool) -> Fusion:
    """The bias + GELU of ``--openai-gelu`` (tanh) or the default (exact erf)."""
    return bias_gelu_tanh if openai_gelu else bias_gelu


def pointwise_fusion(m, expert: bool = False) -> Fusion:
    """The bias + activation of a non-gated MLP of model config ``m``: squared ReLU (``--squared-relu``),
    tanh GELU (``--openai-gelu``) or exact GELU (``expert``: the dynamic-shape twin)."""
    if m.squared_relu:
        return expert_bias_squared_relu if expert else bias_squared_relu
    if expert:
        return expert_bias_gelu_tanh if m.openai_gelu else expert_bias_gelu
    return gelu_fusion(m.openai_gelu)


@fusion("bias_swiglu")
def bias_swiglu(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``silu(gate) * up`` for ``[gate ; up] = x + bias`` split in halves on the last dimension."""
    gate, up = torch.chunk(x if bias is None else x + bias, 2, dim=-1)
    return F.silu(gate) * up


@fusion("bias_gated")
def bias_gated(x: torch.Tensor, bias: Optional[torch.Tensor], quick: bool, offset: float, clamp) -> torch.Tensor:
    """Megatron's gated MLP with its gpt-oss options: for ``[gate ; up] = x + bias`` (halves of the last
    dimension), ``act(gate) * (up + offset)`` with ``act`` quick-GELU ``g sigmoid(1.702 g)`` (``quick``,
    ``--quick-geglu``) or SiLU; with ``clamp`` c (``--activation-func-clamp-value``) the gate is first
    clamped to at most c and ``up`` to ``[-c, c]``."""
    gate, up = torch.chunk(x if bias is None else x + bias, 2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(-clamp, clamp)
    act = gate * torch.sigmoid(1.702 * gate) if quick else F.silu(gate)
    return act * (up + offset) if offset else act * up


def glu_activation(m, plan_enabled: bool, expert: bool = False):
    """``(x, bias) -> activation`` of a gated MLP: the plain SwiGLU fusion, or :func:`bias_gated` with
    the model's quick-GEGLU / offset / clamp bound (``expert``: the dynamic-shape twin)."""
    if m.swiglu and not m.glu_linear_offset and m.activation_func_clamp_value is None:
        base = expert_bias_swiglu if expert else bias_swiglu
        return base if plan_enabled else base.eager
    fused = expert_bias_gated if expert else bias_gated
    fn = fused if plan_enabled else fused.eager
    quick, offset, clamp = m.quick_geglu, float(m.glu_linear_offset), m.activation_func_clamp_value
    return lambda x, bias: fn(x, bias, quick, offset, clamp)


expert_bias_gelu = Fusion(bias_gelu.eager, "expert_bias_gelu", dynamic=True)
expert_bias_gelu_tanh = Fusion(bias_gelu_tanh.eager, "expert_bias_gelu_tanh", dynamic=True)
expert_bias_squared_relu = Fusion(bias_squared_relu.eager, "expert_bias_squared_relu", dynamic=True)
expert_bias_swiglu = Fusion(bias_swiglu.eager, "expert_bias_swiglu", dynamic=True)
expert_bias_gated = Fusion(bias_gated.eager, "expert_bias_gated", dynamic=True)
