"""Causal self-attention with tensor-parallel heads (multi-head and grouped-query).

The fused QKV weight has Megatron's grouped layout: for each query group ``g`` the rows are
``[q heads of group g ; k_g ; v_g]`` (``(heads/groups + 2) * head_dim`` rows per group),
so splitting dim 0 over TP ranks gives each rank whole groups: rank ``r`` owns groups
``[r G/tp, (r+1) G/tp)`` and their query heads.  Multi-head attention is the case
``groups == heads``.

Communication: ``linear_qkv`` (column parallel) — forward nothing (all-gather of the
sequence under SP), backward all-reduce (reduce-scatter under SP) of the input gradient;
``linear_proj`` (row parallel) — forward all-reduce (reduce-scatter under SP), backward
nothing (all-gather under SP).  The attention core is local to each rank's heads.

The core runs on the plan's backend (:mod:`megalm.fusions.backends`): PyTorch SDPA,
flash-attn, the blocked causal attention (:mod:`megalm.transformer.blocked_attention`), or the
unfused ``softmax(QK^T / sqrt(d) + causal) V`` with its scaled masked softmax compiled or eager.
RoPE on q and k is one fused call when the plan compiles it.  ``--qk-layernorm`` normalizes each
query and key head over its ``head_dim`` before RoPE (``q_layernorm`` / ``k_layernorm``, replicated
over TP: each rank's heads give a partial weight gradient, summed over the TP group with the
sequence-parallel norms').  ``--add-qkv-bias`` gives ``linear_qkv`` a bias under
``--disable-bias-linear``.

Under context parallelism (``cp_group`` of more than one rank) each rank holds two chunks of the
sequence and the core is :func:`megalm.context_parallel.context_parallel_attention` over
``cp_group`` (``cp_comm_type`` p2p / a2a / allgather; its communication is described there); a2a
runs the SDPA, blocked or unfused core on the full sequence of its heads.  No flash-attn or TE core
under CP (refused by the configuration checks).

Attention dropout under CP is position-keyed (:mod:`megalm.context_parallel.keyed_dropout`): each
forward call draws a 64-bit key from the tracker's model-parallel stream, and every attention weight's
keep decision is a hash of (key, layer, batch, head, global query and key positions), applied by the
CP cores to the blocks they compute and regenerated in backward.  Without CP the backend's own
dropout runs, unless ``--position-keyed-attention-dropout`` asks for the keyed one (then the core is
:func:`megalm.context_parallel.blocks.local_attention`, whose result equals any CP size's).

``attention_mask`` (``--reset-attention-mask``; boolean ``[b, 1, s, s]``, True where attention is
allowed, already causal: :mod:`megalm.transformer.attention_mask`) replaces the causal mask in the
SDPA, blocked and unfused cores; flash-attn takes no mask, so a flash-attn plan runs SDPA with it
(an explicit ``--attention-backend flash``, TE layers, context parallelism and position-keyed dropout
are refused with it).

``attention_mask`` may instead be a :class:`~megalm.transformer.packed_seq.PackedSeqParams` (``--qkv-format
thd``): the same documents as cumulative sequence lengths, attended one segment at a time without an
``s x s`` mask (:mod:`megalm.transformer.varlen_attention`; flash-attn's varlen kernel on a flash-attn
plan, windows included); under context parallelism with ``a2a`` (whose core sees the whole sequence of a
slice of the heads) it is that core; ``allgather`` and ``p2p`` take the documents' ids and mask other
documents' keys per chunk / ring block.  TE layers and position-keyed dropout are refused with it.

gpt-oss (:mod:`megalm.config.gptoss`): a layer's sliding window (``--window-size`` /
``--window-attn-skip-freq``) and softmax sinks (``--softmax-type``; learnable ones are
``core_attention.softmax_offset``, split over TP with the heads) run in the blocked core per block, in
the SDPA, unfused and flash-attn plans as SDPA with the window mask and a sink column
(:mod:`megalm.fusions.attention_variants`), in KV-cache generation, and under context parallelism
with ``a2a`` (the local core on a slice of the heads) and ``allgather``; ``p2p``, TE and position-keyed
dropout are refused by the configuration checks.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalm.config.gptoss import layer_window
from megalm.config.sections import ConfigError
from megalm.context_parallel import context_parallel_attention
from megalm.context_parallel.blocks import BlockDocuments, BlockDropout, local_attention
from megalm.context_parallel.chunks import ContextParallelError
from megalm.context_parallel.keyed_dropout import KeyedDropout
from megalm.device import get_device
from megalm.fusions import backends
from megalm.fusions.attention_variants import variant_attention
from megalm.fusions.backends import EAGER, FusionPlan
from megalm.fusions.compile import select
from megalm.fusions.rope import rotary_qk
from megalm.fusions.softmax import masked_scaled_softmax, scaled_causal_softmax
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalm.tensor_parallel.param_info import set_param_info
from megalm.tensor_parallel.random import RNGStatesTracker, checkpoint, dropout_rng
from megalm.tensor_parallel.utils import divide, set_tensor_model_parallel_attributes
from megalm.transformer.blocked_attention import blocked_causal_attention
from megalm.transformer.norm import build_norm
from megalm.transformer.packed_seq import PackedSeqParams, document_ids
from megalm.transformer.utils import init_std, output_init_std
from megalm.transformer.varlen_attention import varlen_attention


class SoftmaxOffset(nn.Module):
    """``--softmax-type learnable``: one sink logit per attention head of this TP rank (split over TP
    with the heads; Megatron's ``core_attention.softmax_offset``), initialised to 0."""

    def __init__(self, heads: int, device=None):
        super().__init__()
        self.softmax_offset = nn.Parameter(torch.zeros(heads, device=device))
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0)
        mark_init(self.softmax_offset, "zeros")


class SelfAttention(nn.Module):
    """``linear_proj(softmax(q k^T / sqrt(d) + causal) v)`` over this rank's heads.

    Input and output ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).  Attention
    dropout runs in the tracker's model-parallel stream (each rank holds different heads).
    With ``recompute_core`` (selective recompute) the core is recomputed in backward.  With
    ``skip_output_bias`` :meth:`forward` returns ``(output, linear_proj bias or None)``.
    ``tp_group``: the tensor-parallel group both projections communicate over; ``cp_group``:
    the context-parallel group the core communicates over (``cp_comm_type``) when it has more
    than one rank.  ``layer_number``: the global layer number (it keys position-keyed dropout).
    ``rng_tracker``: the model's RNG tracker (the dropout stream and recomputation); a new, unseeded
    one when None (a layer built alone: seed it with ``model_parallel_manual_seed(.., tracker=)``).
    """

    def __init__(
        self,
        model_cfg,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
        plan: FusionPlan = EAGER,
        skip_output_bias: bool = False,
        *,
        tp_group,
        cp_group,
        cp_comm_type: str = "p2p",
        layer_number: int = 0,
        rng_tracker: Optional[RNGStatesTracker] = None,
    ):
        super().__init__()
        m = model_cfg
        num_groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
        self.init_core(
            m, num_groups, m.head_dim, plan, recompute_core, tp_group, cp_group, cp_comm_type, layer_number, rng_tracker
        )
        tp = group_size(self.tp_group)
        qkv_size = (m.num_attention_heads + 2 * num_groups) * self.head_dim
        self.linear_qkv, self.linear_proj = self.build_projections(m, qkv_size, sequence_parallel, skip_output_bias)
        # The grouped row layout, for Muon's QKV split (query, key, value rows per query group).
        qkv_split = (self.queries_per_group * self.head_dim, self.head_dim, self.head_dim)
        set_param_info(self.linear_qkv.weight, qkv_split_shapes=qkv_split)
        self.q_layernorm = self.k_layernorm = None
        if m.qk_layernorm:  # per head over head_dim; each TP rank's heads give partial weight gradients
            self.q_layernorm, self.k_layernorm = (
                build_norm(m.normalization, self.head_dim, m.norm_epsilon, tp > 1, plan.norm, m.apply_layernorm_1p)
                for _ in range(2)
            )

    def init_core(
        self,
        m,
        num_groups: int,
        head_dim: int,
        plan: FusionPlan,
        recompute_core: bool,
        tp_group,
        cp_group,
        cp_comm_type: str,
        layer_number: int,
        rng_tracker: Optional[RNGStatesTracker] = None,
    ) -> None:
        """The attention core's settings (shared with :class:`~megalm.transformer.mla.MLASelfAttention`):
        groups, heads and ``head_dim`` of the q/k the core sees, its backend, dropout and groups."""
        self.tp_group = tp_group
        self.cp_group = cp_group
        self.rng_tracker = RNGStatesTracker() if rng_tracker is None else rng_tracker
        self.cp_size = group_size(self.cp_group)
        self.cp_comm_type = cp_comm_type
        tp = group_size(self.tp_group)
        self.head_dim = head_dim
        self.queries_per_group = divide(m.num_attention_heads, num_groups)
        self.groups_per_rank = divide(num_groups, tp)
        self.heads_per_rank = divide(m.num_attention_heads, tp)
        self.attention_dropout = m.attention_dropout
        self.layer_number = layer_number
        # Position-keyed dropout (always under CP: a mask that does not depend on the split).
        self.keyed_dropout = m.position_keyed_attention_dropout or self.cp_size > 1
        self.recompute_core = recompute_core
        self.backend = plan.attention
        if self.backend == "blocked" and m.attention_dropout > 0 and not self.keyed_dropout:  # as validate_config
            raise ConfigError(
                f"the blocked attention has no attention dropout: set --attention-dropout 0 "
                f"(got {m.attention_dropout}) or use another --attention-backend"
            )
        self.rotary_qk = select(rotary_qk, plan.compiled("rope"))
        self.masked_softmax = select(scaled_causal_softmax, plan.compiled("masked_softmax"))
        # gpt-oss: this layer's sliding window (None: full) and softmax sinks (megalm.config.gptoss).
        self.window = layer_window(m, layer_number)
        self.softmax_type = m.softmax_type
        if m.softmax_type == "learnable":
            self.core_attention = SoftmaxOffset(self.heads_per_rank, get_device())
        self.variant = self.window is not None or m.softmax_type != "vanilla"

    def build_projections(self, m, qkv_size: int, sequence_parallel: bool, skip_output_bias: bool):
        """``(linear_qkv, linear_proj)``: column- and row-parallel linears (TE's in
        :class:`megalm.transformer.te_layers.TESelfAttention`)."""
        linear_qkv = ColumnParallelLinear(
            m.hidden_size,
            qkv_size,
            bias=m.add_bias_linear or m.add_qkv_bias,
            init_std=init_std(m),
            sequence_parallel=sequence_parallel,
            tp_group=self.tp_group,
        )
        linear_proj = RowParallelLinear(
            m.num_attention_heads * self.head_dim,
            m.hidden_size,
            bias=m.add_bias_linear,
            init_std=output_init_std(m),
            sequence_parallel=sequence_parallel,
            skip_bias_add=skip_output_bias,
            tp_group=self.tp_group,
        )
        return linear_qkv, linear_proj

    def sinks(self, q: torch.Tensor) -> Optional[torch.Tensor]:
        """The sink logits of ``q``'s heads (``[heads]``; None with the vanilla softmax).  Under a2a context
        parallelism the core sees ``heads_r / CP`` heads: this CP rank's slice."""
        if self.softmax_type == "vanilla":
            return None
        heads = q.shape[1]
        if self.softmax_type == "off-by-one":
            return torch.zeros(heads, dtype=q.dtype, device=q.device)
        offset = group_rank(self.cp_group) * heads if heads != self.heads_per_rank else 0
        return self.core_attention.softmax_offset[offset : offset + heads]

    def split_qkv(self, mixed: torch.Tensor):
        """``[s, b, groups_r * (q_per_group + 2) * d]`` -> q ``[s, b, heads_r, d]``, k, v ``[s, b, groups_r, d]``."""
        s, b = mixed.shape[:2]
        d = self.head_dim
        grouped = mixed.view(s, b, self.groups_per_rank, (self.queries_per_group + 2) * d)
        q, k, v = torch.split(grouped, [self.queries_per_group * d, d, d], dim=-1)
        return q.reshape(s, b, self.heads_per_rank, d), k, v

    def attention_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Causal attention on ``[s, b, n, d]`` tensors (or masked by ``attention_mask``); returns
        ``[s, b, heads_r * d]``.  Dropout on the attention weights draws from the tracker's
        model-parallel stream (heads differ per rank): the whole mask, or under position-keyed dropout
        the call's key (:meth:`_keyed_core`)."""
        s, b = q.shape[:2]
        p = self.attention_dropout if self.training else 0.0
        if self.keyed_dropout and p > 0.0:
            packed = attention_mask if isinstance(attention_mask, PackedSeqParams) else None
            if attention_mask is not None and packed is None:  # the dense mask (validate_config refuses the pair)
                raise ConfigError(
                    "--reset-attention-mask without --qkv-format thd is not supported with position-keyed attention "
                    "dropout"
                )
            return self._keyed_core(q, k, v, p, packed).reshape(s, b, -1)
        if self.cp_size > 1:
            core, documents = self._causal_core, None
            packed = isinstance(attention_mask, PackedSeqParams)
            if packed and self.cp_comm_type == "a2a":
                core = partial(self._packed_heads_core, params=attention_mask)  # a2a's core sees the whole sequence
            elif packed:  # allgather masks other documents per chunk, p2p per ring block
                documents = document_ids(attention_mask)
            elif attention_mask is not None:
                raise ContextParallelError("--reset-attention-mask under context parallelism needs --qkv-format thd")
            variant = (self.window, self.sinks(q.transpose(1, 2))) if self.variant else None
            out = context_parallel_attention(
                q, k, v, self.cp_group, self.cp_comm_type, core, variant=variant, documents=documents
            )
            return out.reshape(s, b, -1)
        if isinstance(attention_mask, PackedSeqParams):
            return self._packed_core(q, k, v, attention_mask, p).reshape(s, b, -1)
        with dropout_rng(self.rng_tracker, p, model_parallel_rng=True):
            if self.backend == "flash-attn" and attention_mask is None and not self.variant:  # [b, s, n, d]; GQA
                out = backends.flash_attn_function()(
                    *(t.transpose(0, 1) for t in (q, k, v)), dropout_p=p, causal=True
                ).transpose(0, 1)
            else:
                heads_first = (t.permute(1, 2, 0, 3) for t in (q, k, v))
                out = self._core_on_heads(*heads_first, p, attention_mask).permute(2, 0, 1, 3)
        return out.reshape(s, b, -1)

    def _packed_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: PackedSeqParams, p: float
    ) -> torch.Tensor:
        """Attention within each packed segment (THD) on ``[s, b, n, d]`` tensors -> ``[s, b, n, d]``: flash-attn's
        varlen kernel on a flash-attn plan without sinks, else this plan's causal core per segment
        (:func:`~megalm.transformer.varlen_attention.varlen_attention`)."""
        flash = None
        if self.backend == "flash-attn" and self.softmax_type == "vanilla":
            flash = backends.flash_attn_varlen_function()
        # Segment lengths change every batch: the unfused core's softmax runs eagerly (a compiled graph per length).
        core = partial(self._core_on_heads, p=p, causal_softmax=scaled_causal_softmax.eager)
        with dropout_rng(self.rng_tracker, p, model_parallel_rng=True):
            return varlen_attention(q, k, v, params, core, flash, self.window, p)

    def _packed_heads_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: PackedSeqParams
    ) -> torch.Tensor:
        """:meth:`_packed_core` without dropout on heads-first tensors of the whole sequence (a2a's core under
        context parallelism; its heads are this CP rank's slice, the segments the whole sequence's)."""
        out = self._packed_core(*(t.permute(2, 0, 1, 3) for t in (q, k, v)), params, 0.0)
        return out.permute(1, 2, 0, 3)

    def _keyed_core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, packed: Optional[PackedSeqParams] = None
    ) -> torch.Tensor:
        """Attention with position-keyed dropout on ``[s, b, n, d]`` tensors -> ``[s, b, n, d]``: the CP
        core of ``cp_comm_type``, or without CP :func:`local_attention` over the whole sequence.  One
        draw of the key from the model-parallel stream (the same on every CP rank; recomputation
        restores the stream, so it draws the same key).  ``packed``: the documents (``--qkv-format thd``),
        masked per tile by their ids (:class:`~megalm.context_parallel.blocks.BlockDocuments`), or None."""
        with dropout_rng(self.rng_tracker, p, model_parallel_rng=True):
            dropout = KeyedDropout.draw(p, self.layer_number, q.device)
        documents = None if packed is None else document_ids(packed)
        if self.cp_size > 1:
            return context_parallel_attention(
                q, k, v, self.cp_group, self.cp_comm_type, self._causal_core, dropout, documents=documents
            )
        positions = torch.arange(q.shape[0], device=q.device)
        heads_first = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        block, docs = BlockDropout(dropout, positions, positions), None
        if documents is not None:
            docs = BlockDocuments(documents, documents)
        return local_attention(*heads_first, dropout=block, documents=docs).permute(2, 0, 1, 3)

    def _causal_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The local core without dropout on heads-first tensors (a2a's core under context parallelism;
        flash-attn / TE plans fall back to SDPA)."""
        if self.backend in ("sdpa", "blocked", "unfused") or self.variant:
            return self._core_on_heads(q, k, v, 0.0)
        gqa = self.groups_per_rank != self.heads_per_rank
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def _core_on_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        p: float,
        mask: Optional[torch.Tensor] = None,
        causal_softmax=None,
    ) -> torch.Tensor:
        """SDPA, blocked or unfused core: ``[b, n, s, d]`` -> ``[b, heads_r, s, d]``; causal, or ``mask``
        (boolean ``[b, 1, s, s]``, True where allowed) instead.  A flash-attn plan given a mask runs SDPA.
        ``causal_softmax``: the unfused core's causal softmax (default: the plan's, compiled or eager)."""
        gqa = self.groups_per_rank != self.heads_per_rank
        if self.variant and self.backend != "blocked":  # window / sinks: SDPA with their mask
            return variant_attention(q, k, v, self.window, self.sinks(q), mask, p)
        if self.backend in ("sdpa", "flash-attn"):
            causal = mask is None
            return F.scaled_dot_product_attention(q, k, v, mask, dropout_p=p, is_causal=causal, enable_gqa=gqa)
        if gqa:
            k, v = (t.repeat_interleave(self.queries_per_group, dim=1) for t in (k, v))
        if self.backend == "blocked":
            return blocked_causal_attention(q, k, v, mask, self.window, self.sinks(q))
        scores = torch.matmul(q, k.transpose(-2, -1))
        if mask is None:
            probs = (causal_softmax or self.masked_softmax)(scores, self.head_dim**-0.5)
        else:
            probs = masked_scaled_softmax(scores, mask, self.head_dim**-0.5)
        return torch.matmul(F.dropout(probs, p) if p > 0.0 else probs, v)

    def cached_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
        """Inference: ``q`` ``[s_new, b, n, d]`` at positions ``offset..``, ``k``/``v`` all ``offset + s_new``
        cached positions; query ``i`` sees keys ``0..offset+i``.  Returns ``[s_new, b, heads_r * d]``."""
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        if self.variant:
            out = variant_attention(q, k, v, self.window, self.sinks(q), query_offset=offset)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        mask = None
        if s > 1:
            query_pos = torch.arange(offset, offset + s, device=q.device).unsqueeze(1)
            mask = torch.arange(k.shape[2], device=q.device).unsqueeze(0) <= query_pos  # [s_new, s_all]
        gqa = self.groups_per_rank != self.heads_per_rank
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary_cos: Optional[torch.Tensor] = None,
        rotary_sin: Optional[torch.Tensor] = None,
        kv_cache=None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``kv_cache`` (inference only): a per-layer cache (:class:`megalm.inference.kv_cache.LayerKVCache`)
        that stores this call's keys/values (after RoPE) and returns all cached ones.  ``attention_mask``:
        see the module docstring (training and evaluation only)."""
        q, k, v = self.split_qkv(self.linear_qkv(hidden))
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_cos is not None:
            q, k = self.rotary_qk(q, k, rotary_cos, rotary_sin)
        if kv_cache is not None:
            if self.cp_size > 1:
                raise ContextParallelError("generation with a KV cache is not supported under context parallelism")
            offset = kv_cache.offset
            k, v = kv_cache.update(k, v)
            context = self.cached_attention(q, k, v, offset)
        elif self.recompute_core:
            context = checkpoint(self.attention_core, q, k, v, attention_mask, rng_tracker=self.rng_tracker)
        else:
            context = self.attention_core(q, k, v, attention_mask)
        return self.linear_proj(context)
