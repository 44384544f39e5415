"""Feed-forward block: ``linear_fc2(act(linear_fc1(x)))`` with GELU, squared ReLU or SwiGLU.

``linear_fc1`` is column parallel (each rank computes ``ffn/tp`` features), ``linear_fc2``
row parallel.  With SwiGLU ``linear_fc1`` is a fused ``[gate; up]`` weight of
``2 * ffn`` rows; TP rank ``r`` holds ``[gate_r; up_r]`` (``partition_stride = 2``), so the
activation ``silu(gate_r) * up_r`` is local.

The bias of ``linear_fc1`` is added inside the activation (``bias_gelu``, ``bias_gelu_tanh`` with
``--openai-gelu``, ``bias_squared_relu`` with ``--squared-relu``, ``bias_swiglu`` of
:mod:`megalm.fusions.activations`, compiled when the plan says so).  With
``skip_output_bias`` :meth:`MLP.forward` returns ``(output, fc2 bias)`` so the layer can fuse
the bias into its bias + dropout + residual add.

Communication: fc1 — forward nothing (all-gather of the sequence under SP), backward
all-reduce (reduce-scatter under SP); fc2 — forward all-reduce (reduce-scatter under SP),
backward nothing (all-gather under SP).
"""

from __future__ import annotations

import torch
from torch import nn

from megalm.fusions.activations import glu_activation, pointwise_fusion
from megalm.fusions.backends import EAGER, FusionPlan
from megalm.fusions.compile import select
from megalm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalm.transformer.utils import init_std, output_init_std


def fc1_layout(m):
    """``(output size, partition stride)`` of ``linear_fc1``: SwiGLU's is ``[gate; up]`` (twice the FFN
    width), split with stride 2 so TP rank ``r`` holds ``[gate_r; up_r]``."""
    return (2 * m.ffn_hidden_size, 2) if m.gated_linear_unit else (m.ffn_hidden_size, 1)


class MLP(nn.Module):
    """Input/output ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism); ``tp_group`` is the
    tensor-parallel group both linears communicate over."""

    def __init__(
        self,
        model_cfg,
        sequence_parallel: bool = False,
        plan: FusionPlan = EAGER,
        skip_output_bias: bool = False,
        *,
        tp_group,
    ):
        super().__init__()
        m = model_cfg
        self.tp_group = tp_group
        self.linear_fc1, self.linear_fc2 = self.build_linears(m, sequence_parallel, skip_output_bias)
        compiled = plan.compiled("bias_activation")
        if m.gated_linear_unit:  # SwiGLU or quick-GEGLU, with gpt-oss's offset / clamp
            self.bias_activation = glu_activation(m, compiled)
        else:
            self.bias_activation = select(pointwise_fusion(m), compiled)

    def build_linears(self, m, sequence_parallel: bool, skip_output_bias: bool):
        """``(linear_fc1, linear_fc2)``; fc1 returns ``(output, bias)`` for the fused bias + activation
        (TE's in :class:`megalm.transformer.te_layers.TEMLP`)."""
        fc1_size, stride = fc1_layout(m)
        linear_fc1 = ColumnParallelLinear(
            m.hidden_size,
            fc1_size,
            bias=m.add_bias_linear,
            init_std=init_std(m),
            stride=stride,
            sequence_parallel=sequence_parallel,
            skip_bias_add=True,
            tp_group=self.tp_group,
        )
        linear_fc2 = RowParallelLinear(
            m.ffn_hidden_size,
            m.hidden_size,
            bias=m.add_bias_linear,
            init_std=output_init_std(m),
            sequence_parallel=sequence_parallel,
            skip_bias_add=skip_output_bias,
            tp_group=self.tp_group,
        )
        return linear_fc1, linear_fc2

    def forward(self, hidden: torch.Tensor):
        """``[s, b, h]`` output, or ``(output, fc2 bias or None)`` with ``skip_output_bias``."""
        return self.linear_fc2(self.bias_activation(*self.linear_fc1(hidden)))
