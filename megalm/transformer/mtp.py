"""Multi-token prediction (DeepSeek-V3, Megatron-LM's ``MultiTokenPredictionBlock``), ``--mtp-num-layers D``.

Depth ``k = 1..D`` predicts the token ``k + 1`` places ahead.  With ``h_0`` the decoder's output
(after its final norm) and ``roll`` shifting a ``[b, s]`` tensor one place left (the last position
becomes 0)::

    tokens_k = roll(tokens_{k-1}),  labels_k = roll(labels_{k-1}),  mask_k = roll(mask_{k-1})
    h_k = final_layernorm_k(transformer_layer_k(eh_proj_k([enorm_k(embed(tokens_k)) ; hnorm_k(h_{k-1})])))
    loss_k = sum(mask_k * CE(output_layer(h_k), labels_k)) / sum(mask_k)

``embed`` and ``output_layer`` are the model's own (shared).  The model's loss is unchanged; the
training objective gains ``--mtp-loss-scaling-factor / D * sum_k loss_k`` (each micro-batch; with
``--calculate-per-token-loss`` the sums are not divided by ``sum(mask_k)``), added to the backward
pass by :class:`~megalm.transformer.moe.aux_losses.MoEAuxLossAutoScaler` on ``h_0`` with the main
loss's backward factor, as Megatron's ``MTPLossAutoScaler``.  ``loss_k`` is reported as
``mtp_<k> loss`` (training only; evaluation skips the MTP layers).

The concatenation order (embedding first) and the norm placement are Megatron's.  Each depth's
transformer layer is built like the last decoder layer (MoE or dense, the same attention), with
global layer number ``num_layers + k - 1`` (its MoE metrics and dropout keys).

Parallelism: ``eh_proj`` is column parallel with its output gathered (``[s, b, h]`` on every TP
rank; forward all-gather of the last dim, backward split) and, under sequence parallelism, its
input gathered along the sequence and its output scattered back.  With pipeline parallelism the
block lives on the last stage (Megatron's placement), which then also receives the tokens, and
holds a copy of the word embedding marked ``tied`` (its gradient summed with the first stage's, as
a tied output layer's).  Under context parallelism each rank holds two chunks of the sequence
(:mod:`megalm.context_parallel.chunks`), so the roll is the global sequence's: the tokens, labels and
mask (``[b, s / CP]`` integers, no gradient) are all-gathered over CP once, rolled in global order and
split back for each depth; each rank's ``loss_k`` back-propagates ``CP * sum_r / N`` with ``N`` the
micro-batch's count over CP (as the main loss, :mod:`megalm.context_parallel.loss`: the gradient
average over data x context ranks divides by CP), and the logged ``loss_k`` is the whole
micro-batch's (one all-reduce of ``[sum_r, n_r]`` over CP per depth).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalm.context_parallel.chunks import gathered_to_global, split_sequence
from megalm.fusions.backends import EAGER, FusionPlan
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.tensor_parallel.layers import ColumnParallelLinear
from megalm.tensor_parallel.mappings import all_gather_first_dim, scatter_to_sequence_parallel_region
from megalm.tensor_parallel.random import RNGStatesTracker
from megalm.transformer.moe.aux_losses import attach_aux_loss
from megalm.transformer.moe.state import MoEState
from megalm.transformer.moe.tracker import MoEMetricsTracker
from megalm.transformer.norm import build_norm
from megalm.transformer.transformer_layer import TransformerLayer
from megalm.transformer.utils import init_std, recompute_modules


def roll_left(x: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` shifted one place left along the sequence; the last position becomes 0."""
    return F.pad(x[:, 1:], (0, 1))


def gather_sequence(x: torch.Tensor, cp_group) -> torch.Tensor:
    """The whole ``[b, s]`` sequence, in global order, from each CP rank's two chunks ``[b, s / CP]``."""
    cp = group_size(cp_group)
    if cp == 1:
        return x
    gathered = all_gather_first_dim(x.t(), cp_group)[0]  # [s, b] in rank order: each rank's chunk pair
    return gathered_to_global(gathered, cp).t()


class MTPLayer(nn.Module):
    """One depth: ``final_layernorm(transformer_layer(eh_proj([enorm(e) ; hnorm(h)])))``."""

    def __init__(
        self,
        m,
        layer_number: int,
        process_groups: ProcessGroups,
        sequence_parallel: bool,
        plan: FusionPlan,
        moe_state: Optional[MoEState],
        cp_comm_type: str,
        recompute_core_attention: bool,
        rng_tracker: Optional[RNGStatesTracker] = None,
    ):
        super().__init__()

        def norm():
            return build_norm(
                m.normalization, m.hidden_size, m.norm_epsilon, sequence_parallel, plan.norm, m.apply_layernorm_1p
            )

        self.sequence_parallel = sequence_parallel
        self.tp_group = process_groups.tp
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = ColumnParallelLinear(
            2 * m.hidden_size,
            m.hidden_size,
            bias=False,
            gather_output=True,
            init_std=init_std(m),
            sequence_parallel=sequence_parallel,
            tp_group=self.tp_group,
        )
        self.transformer_layer = TransformerLayer(
            m,
            layer_number,
            process_groups,
            sequence_parallel,
            recompute_core_attention=recompute_core_attention,
            plan=plan,
            moe_state=moe_state,
            cp_comm_type=cp_comm_type,
            rng_tracker=rng_tracker,
        )
        self.final_layernorm = norm()

    def forward(self, embedded, hidden, rotary_cos, rotary_sin, attention_mask=None):
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        x = self.transformer_layer(x, rotary_cos, rotary_sin, attention_mask=attention_mask)
        return self.final_layernorm(x)


class MultiTokenPrediction(nn.Module):
    """The ``--mtp-num-layers`` depths (parameter names ``mtp.layers.<k-1>.*``, Megatron's)."""

    def __init__(
        self,
        model_cfg,
        process_groups: ProcessGroups,
        sequence_parallel: bool = False,
        plan: FusionPlan = EAGER,
        moe_state: Optional[MoEState] = None,
        cp_comm_type: str = "p2p",
        per_token_loss: bool = False,
        rng_tracker: Optional[RNGStatesTracker] = None,
    ):
        super().__init__()
        m = model_cfg
        self.num_layers = m.mtp_num_layers
        self.scale = m.mtp_loss_scaling_factor / m.mtp_num_layers
        self.per_token_loss = per_token_loss
        self.cp_group = process_groups.cp
        self.aux_state = moe_state if moe_state is not None else MoEState()
        self.metrics = MoEMetricsTracker()
        selective = "core_attn" in recompute_modules(m)
        rng_tracker = RNGStatesTracker() if rng_tracker is None else rng_tracker  # one for every depth
        self.layers = nn.ModuleList(
            [
                MTPLayer(
                    m,
                    m.num_layers + k,
                    process_groups,
                    sequence_parallel,
                    plan,
                    moe_state,
                    cp_comm_type,
                    selective,
                    rng_tracker,
                )
                for k in range(self.num_layers)
            ]
        )

    def forward(self, hidden, tokens, labels, loss_mask, position_ids, embed, loss_of, rotary_cos, rotary_sin, mask):
        """``hidden`` (the decoder's normalized output) with every depth's scaled loss attached.
        ``embed(tokens, position_ids)`` -> ``[s(/tp), b, h]``; ``loss_of(h, labels, mask)`` -> per-token ``[b, s]``."""
        main = hidden
        if loss_mask is None:
            loss_mask = torch.ones_like(labels, dtype=torch.float32)
        cp, cp_rank = group_size(self.cp_group), group_rank(self.cp_group)
        whole = [gather_sequence(t, self.cp_group) for t in (tokens, labels, loss_mask.float())]
        for k, layer in enumerate(self.layers):
            whole = [roll_left(t) for t in whole]
            tokens, labels, loss_mask = (split_sequence(t, 1, cp_rank, cp) for t in whole)
            hidden = layer(embed(tokens, position_ids), hidden, rotary_cos, rotary_sin, mask)
            total = (loss_of(hidden, labels, loss_mask).float() * loss_mask).sum()
            count = whole[2].sum().clamp(min=1.0)  # the micro-batch's, over every CP rank
            reported = total.detach().clone()
            if cp > 1:
                dist.all_reduce(reported, group=self.cp_group)
            self.metrics.record(k, f"mtp_{k + 1} loss", reported / count)
            loss = cp * (total if self.per_token_loss else total / count)
            main = attach_aux_loss(main, self.scale * loss, self.aux_state)
        return main

    def pop_metrics(self) -> Dict[str, torch.Tensor]:
        """``{"mtp_<k> loss": value}`` recorded since the last call ({} in evaluation)."""
        return self.metrics.pop() if self.metrics else {}
