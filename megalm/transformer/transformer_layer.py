"""One pre-norm transformer layer:

    x = x + dropout(self_attention(input_layernorm(x)) + proj_bias)
    x = x + dropout(mlp(pre_mlp_layernorm(x)) + fc2_bias)

Each line's bias + dropout + residual add is one call of
:func:`megalm.fusions.dropout_add.bias_dropout_add` (compiled when the fusion plan says so).

Activations ``[s, b, h]``; under sequence parallelism ``[s/tp, b, h]``, the norms and the
hidden dropout work on this rank's slice of the sequence and the dropout draws from the
tracker's model-parallel stream.  Communication is that of the attention and MLP blocks.

``mlp`` is a dense :class:`~megalm.transformer.mlp.MLP`, or a
:class:`~megalm.transformer.moe.MoELayer` on the layers ``--num-experts`` /
``--moe-layer-freq`` select (:func:`~megalm.transformer.moe.is_moe_layer`).

With Transformer Engine layers (``plan.uses_te()``, :mod:`megalm.transformer.te_layers`) the
attention and dense MLP are TE's and normalize their own input, so ``input_layernorm`` and a
dense layer's ``pre_mlp_layernorm`` are identities; MoE layers keep megalm's norm and experts.

Selective recomputation (``--recompute-modules``, Megatron's names): ``layernorm`` recomputes the two
norms, ``mlp`` a dense MLP, ``moe`` a whole MoE block in backward (``core_attn``, ``mla_up_proj``,
``moe_act`` and ``shared_experts`` are handled inside the attention and MoE blocks).

Process groups: ``process_groups`` (a :class:`~megalm.parallel_state.ProcessGroups`) gives
attention and MLP their ``tp`` group (attention also its ``cp`` group, with ``cp_comm_type``)
and an MoE block its ``tp`` and ``ep`` groups.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from megalm.fusions.backends import EAGER, FusionPlan
from megalm.fusions.compile import select
from megalm.fusions.dropout_add import bias_dropout_add
from megalm.parallel_state import ProcessGroups
from megalm.tensor_parallel.random import RNGStatesTracker, checkpoint, dropout_rng
from megalm.transformer.attention import SelfAttention
from megalm.transformer.mla import MLASelfAttention
from megalm.transformer.mlp import MLP
from megalm.transformer.moe.moe_layer import MoELayer, is_moe_layer
from megalm.transformer.moe.state import MoEState
from megalm.transformer.norm import build_norm
from megalm.transformer.te_layers import TEMLP, TESelfAttention
from megalm.transformer.utils import recompute_modules


class TransformerLayer(nn.Module):
    def __init__(
        self,
        model_cfg,
        layer_number: int,
        process_groups: ProcessGroups,
        sequence_parallel: bool = False,
        recompute_core_attention: bool = False,
        plan: FusionPlan = EAGER,
        moe_state: Optional[MoEState] = None,
        cp_comm_type: str = "p2p",
        rng_tracker: Optional[RNGStatesTracker] = None,
    ):
        super().__init__()
        m = model_cfg
        self.layer_number = layer_number  # global, 0-based
        # the model's (shared with the attention): dropout under SP and recomputation; new when None
        self.rng_tracker = RNGStatesTracker() if rng_tracker is None else rng_tracker
        self.hidden_dropout = m.hidden_dropout
        self.sequence_parallel = sequence_parallel
        te = plan.uses_te()  # TE's attention / MLP fuse the norm before them: the layer's norm is an identity
        te_attention = te and not m.multi_latent_attention  # MLA is megalm's own layer

        def norm(fused_away: bool) -> nn.Module:
            return (
                nn.Identity()
                if fused_away
                else build_norm(
                    m.normalization, m.hidden_size, m.norm_epsilon, sequence_parallel, plan.norm, m.apply_layernorm_1p
                )
            )

        self.input_layernorm = norm(te_attention)
        pg = process_groups
        attention_class = TESelfAttention if te_attention else SelfAttention
        if m.multi_latent_attention:
            attention_class = MLASelfAttention
        self.self_attention = attention_class(
            m,
            sequence_parallel,
            recompute_core=recompute_core_attention,
            plan=plan,
            skip_output_bias=True,
            tp_group=pg.tp,
            cp_group=pg.cp,
            cp_comm_type=cp_comm_type,
            layer_number=layer_number,
            rng_tracker=self.rng_tracker,
        )
        self.is_moe = is_moe_layer(m, layer_number)
        self.pre_mlp_layernorm = norm(te and not self.is_moe)
        self.mlp = (
            MoELayer(
                m,
                layer_number,
                sequence_parallel,
                plan=plan,
                tp_group=pg.tp,
                ep_group=pg.ep,
                etp_group=pg.etp,
                moe_state=moe_state,
                cp_group=pg.cp,
                tp_cp_group=pg.tp_cp,
            )
            if self.is_moe
            else (TEMLP if te else MLP)(m, sequence_parallel, plan=plan, skip_output_bias=True, tp_group=pg.tp)
        )
        self.bias_dropout_add = select(bias_dropout_add, plan.compiled("bias_dropout_add"))
        recompute = recompute_modules(m)
        self.recompute_norms = "layernorm" in recompute
        # a dense MLP with "mlp", an MoE block with "moe" (its parts: "moe_act", "shared_experts")
        self.recompute_mlp = ("moe" if self.is_moe else "mlp") in recompute

    def _run(self, module: nn.Module, recompute: bool, x: torch.Tensor):
        return checkpoint(module, x, rng_tracker=self.rng_tracker) if recompute else module(x)

    def _residual_add(
        self, out: Union[torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]], residual: torch.Tensor
    ) -> torch.Tensor:
        """``residual + dropout(out + bias)``; under sequence parallelism the mask comes from the
        tracker's model-parallel stream (each rank holds a different slice of the sequence)."""
        out, bias = out if isinstance(out, tuple) else (out, None)  # the MoE layer has no output bias
        p = self.hidden_dropout if self.training else 0.0
        with dropout_rng(self.rng_tracker, p, model_parallel_rng=self.sequence_parallel):
            return self.bias_dropout_add(out, bias, residual, p, self.training)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary_cos: Optional[torch.Tensor] = None,
        rotary_sin: Optional[torch.Tensor] = None,
        kv_cache=None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``kv_cache``: this layer's inference cache; ``attention_mask``: the document mask of
        ``--reset-attention-mask`` (see :class:`~megalm.transformer.attention.SelfAttention`)."""
        normed = self._run(self.input_layernorm, self.recompute_norms and kv_cache is None, hidden)
        if kv_cache is None and attention_mask is not None:
            attention_out = self.self_attention(normed, rotary_cos, rotary_sin, attention_mask=attention_mask)
        elif kv_cache is None:
            attention_out = self.self_attention(normed, rotary_cos, rotary_sin)
        else:
            attention_out = self.self_attention(normed, rotary_cos, rotary_sin, kv_cache=kv_cache)
        hidden = self._residual_add(attention_out, hidden)
        normed = self._run(self.pre_mlp_layernorm, self.recompute_norms and kv_cache is None, hidden)
        return self._residual_add(self._run(self.mlp, self.recompute_mlp and kv_cache is None, normed), hidden)
