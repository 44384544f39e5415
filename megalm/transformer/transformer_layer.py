"""One pre-norm transformer layer:

    x = x + dropout(self_attention(input_layernorm(x)))
    x = x + dropout(mlp(pre_mlp_layernorm(x)))

Activations ``[s, b, h]``; under sequence parallelism ``[s/tp, b, h]``, the norms and the
hidden dropout work on this rank's slice of the sequence and the dropout draws from the
tracker's model-parallel stream.  Communication is that of the attention and MLP blocks.

``mlp`` is a dense :class:`~megalm.transformer.mlp.MLP`, or a
:class:`~megalm.transformer.moe.MoELayer` on the layers ``--num-experts`` /
``--moe-layer-freq`` select (:func:`~megalm.transformer.moe.is_moe_layer`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megalm.tensor_parallel.random import dropout
from megalm.transformer.attention import SelfAttention
from megalm.transformer.mlp import MLP
from megalm.transformer.moe.moe_layer import MoELayer, is_moe_layer
from megalm.transformer.norm import build_norm


class TransformerLayer(nn.Module):
    def __init__(self, model_cfg, layer_number: int, sequence_parallel: bool = False,
                 recompute_core_attention: bool = False):
        super().__init__()
        m = model_cfg
        self.layer_number = layer_number  # global, 0-based
        self.hidden_dropout = m.hidden_dropout
        self.sequence_parallel = sequence_parallel
        self.input_layernorm = build_norm(m.normalization, m.hidden_size, m.norm_epsilon, sequence_parallel)
        self.self_attention = SelfAttention(m, sequence_parallel, recompute_core=recompute_core_attention)
        self.pre_mlp_layernorm = build_norm(m.normalization, m.hidden_size, m.norm_epsilon, sequence_parallel)
        self.is_moe = is_moe_layer(m, layer_number)
        self.mlp = MoELayer(m, layer_number, sequence_parallel) if self.is_moe else MLP(m, sequence_parallel)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.hidden_dropout, self.training, model_parallel_rng=self.sequence_parallel)

    def forward(self, hidden: torch.Tensor, rotary_cos: Optional[torch.Tensor] = None,
                rotary_sin: Optional[torch.Tensor] = None, kv_cache=None) -> torch.Tensor:
        """``kv_cache``: this layer's inference cache (see :class:`~megalm.transformer.attention.SelfAttention`)."""
        if kv_cache is None:
            attention_out = self.self_attention(self.input_layernorm(hidden), rotary_cos, rotary_sin)
        else:
            attention_out = self.self_attention(self.input_layernorm(hidden), rotary_cos, rotary_sin, kv_cache=kv_cache)
        hidden = hidden + self._dropout(attention_out)
        return hidden + self._dropout(self.mlp(self.pre_mlp_layernorm(hidden)))
