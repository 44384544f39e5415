"""Multi-latent attention (DeepSeek-V2/V3, Megatron-LM's ``MLASelfAttention``), ``--multi-latent-attention``.

With ``n`` heads, ``d_n = --qk-head-dim``, ``d_r = --qk-pos-emb-head-dim``, ``d_v = --v-head-dim``::

    q      = linear_q_up_proj(q_layernorm(linear_q_down_proj(x)))     [s, b, n, d_n + d_r]
             (or linear_q_proj(x) without --q-lora-rank)
    c, k_r = split(linear_kv_down_proj(x), [--kv-lora-rank, d_r])     latent and the shared RoPE key
    k_n, v = split(linear_kv_up_proj(kv_layernorm(c)), [d_n, d_v])    per head
    q = [q_n ; rope(q_r)],  k = [k_n ; rope(k_r) for every head]
    out = linear_proj(softmax(scale q k^T + causal) v),   scale = mscale_all_dim^2 / sqrt(d_n + d_r)

``q_layernorm`` / ``kv_layernorm`` (over the latents) exist with ``--qk-layernorm`` (Megatron's
spec).  RoPE: the ``d_r`` channels are first de-interleaved (``[x0, x2, ..; x1, x3, ..]``, as Megatron's
``multi_latent_attention`` path and Hugging Face's ``rope_interleave``), then rotated with the
rotate-half tables of :class:`~megalm.transformer.rope.RotaryEmbedding` over ``d_r`` (YaRN by default).

Tensor parallelism: the down projections and the latent norms are replicated on every TP rank;
``linear_q_proj`` / ``linear_q_up_proj`` / ``linear_kv_up_proj`` are column parallel (each rank
its ``n / tp`` heads; forward nothing, backward all-reduce of the latent's gradient) and
``linear_proj`` row parallel (forward all-reduce).  The shared RoPE key goes through
``copy_to_tensor_model_parallel_region`` (backward: all-reduce of its per-head partial gradient).
Under sequence parallelism the down projections see this rank's ``s/tp`` positions; the up
projections all-gather the latents (backward reduce-scatter), the RoPE key is all-gathered
(backward reduce-scatter), and the replicated weights' partial gradients are summed over TP
after backward (``sequence_parallel`` in their :class:`~megalm.tensor_parallel.param_info.ParamInfo`).

The core is :class:`~megalm.transformer.attention.SelfAttention`'s (every backend, context
parallelism, position-keyed dropout); when it needs one head dim (anything but SDPA without CP)
``v`` is zero-padded to ``d_n + d_r`` and the padding cut from the output.  A softmax scale other
than ``1/sqrt(d_n + d_r)`` (YaRN's ``mscale_all_dim``) is applied to ``q`` first.

``--recompute-modules mla_up_proj`` keeps only the latents and the RoPE key: the up projections and
RoPE are recomputed in backward (Megatron's ``mla_up_proj``).

KV-cache generation caches the *compressed* state: per position the normalized latent ``c``
(``--kv-lora-rank``) and the rotated RoPE key (``d_r``): ``kv_lora_rank + d_r`` numbers per position and
layer instead of the ``n (d_n + d_r + d_v)`` of the expanded keys and values, which are re-expanded
from it (``linear_kv_up_proj``) at each step, as Hugging Face's DeepSeek-V3 does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalm.context_parallel.chunks import ContextParallelError
from megalm.device import get_device
from megalm.fusions.backends import EAGER, FusionPlan
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalm.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megalm.tensor_parallel.param_info import set_param_info
from megalm.tensor_parallel.random import RNGStatesTracker, checkpoint
from megalm.transformer.attention import SelfAttention
from megalm.transformer.norm import build_norm
from megalm.transformer.utils import init_std, output_init_std, recompute_modules
from megalm.transformer.yarn import YarnScaling


class ReplicatedLinear(nn.Module):
    """``x W^T (+ b)`` with the whole weight on every tensor-parallel rank (Megatron's "duplicated"
    linear).  ``sequence_parallel``: inputs are this rank's slice of the sequence, so the weight's
    gradient is partial and summed over TP after backward.  No communication of its own."""

    def __init__(self, in_features: int, out_features: int, bias: bool, std: float, sequence_parallel: bool):
        super().__init__()
        device = get_device()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float32, device=device))
        mark_init(self.weight, "normal", std)
        set_param_info(self.weight, sequence_parallel=sequence_parallel)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=torch.float32, device=device))
            mark_init(self.bias, "zeros")
            set_param_info(self.bias, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[.., x0, x1, x2, x3, ..]`` -> ``[.., x0, x2, ..; x1, x3, ..]`` on the last dim."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_softmax_scale(m) -> float:
    """``mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)`` (YaRN), else ``1/sqrt(.)``."""
    scale = (m.qk_head_dim + m.qk_pos_emb_head_dim) ** -0.5
    if m.rope_type == "yarn":
        scale *= YarnScaling.from_model_config(m).softmax_scale_factor
    return scale


class MLASelfAttention(SelfAttention):
    """Multi-latent attention with :class:`SelfAttention`'s interface (see the module docstring)."""

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
        nn.Module.__init__(self)
        m = model_cfg
        self.qk_dim, self.pos_dim, self.v_dim = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim
        q_head = self.qk_dim + self.pos_dim
        self.init_core(
            m,
            m.num_attention_heads,
            q_head,
            plan,
            recompute_core,
            tp_group,
            cp_group,
            cp_comm_type,
            layer_number,
            rng_tracker,
        )
        self.sequence_parallel = sequence_parallel
        self.recompute_up = "mla_up_proj" in recompute_modules(m)
        self.kv_lora_rank, self.q_lora_rank = m.kv_lora_rank, m.q_lora_rank
        n, h, bias, std = m.num_attention_heads, m.hidden_size, m.add_bias_linear, init_std(m)

        def column(inp: int, out: int, sp: bool) -> ColumnParallelLinear:
            return ColumnParallelLinear(inp, out, bias=bias, init_std=std, sequence_parallel=sp, tp_group=self.tp_group)

        def norm(size: int) -> Optional[nn.Module]:
            if not m.qk_layernorm:
                return None
            return build_norm(m.normalization, size, m.norm_epsilon, sequence_parallel, plan.norm, m.apply_layernorm_1p)

        if self.q_lora_rank is None:
            self.linear_q_proj = column(h, n * q_head, sequence_parallel)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, self.q_lora_rank, bias, std, sequence_parallel)
            self.q_layernorm = norm(self.q_lora_rank)
            self.linear_q_up_proj = column(self.q_lora_rank, n * q_head, sequence_parallel)
        self.linear_kv_down_proj = ReplicatedLinear(h, self.kv_lora_rank + self.pos_dim, bias, std, sequence_parallel)
        self.kv_layernorm = norm(self.kv_lora_rank)
        self.linear_kv_up_proj = column(self.kv_lora_rank, n * (self.qk_dim + self.v_dim), sequence_parallel)
        self.linear_proj = RowParallelLinear(
            n * self.v_dim,
            h,
            bias=bias,
            init_std=output_init_std(m),
            sequence_parallel=sequence_parallel,
            skip_bias_add=skip_output_bias,
            tp_group=self.tp_group,
        )
        # A softmax scale other than 1/sqrt(q_head) is applied to q (the cores scale by 1/sqrt(d)).
        self.q_factor = mla_softmax_scale(m) * math.sqrt(q_head)
        if abs(self.q_factor - 1.0) < 1e-12:
            self.q_factor = 1.0

    # --- projections -----------------------------------------------------------------------------

    def _query_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The normalized query latent ``[s(/tp), b, q_lora_rank]``, or without ``--q-lora-rank`` the
        projected queries ``[s, b, heads_r * (d_n + d_r)]``."""
        if self.q_lora_rank is None:
            return self.linear_q_proj(hidden)
        latent = self.linear_q_down_proj(hidden)
        return latent if self.q_layernorm is None else self.q_layernorm(latent)

    def _query(self, q_input: torch.Tensor) -> torch.Tensor:
        """``[s, b, heads_r, d_n + d_r]`` (the full sequence under SP)."""
        q = q_input if self.q_lora_rank is None else self.linear_q_up_proj(q_input)
        return q.view(q.shape[0], q.shape[1], self.heads_per_rank, self.qk_dim + self.pos_dim)

    def _compressed_kv(self, hidden: torch.Tensor):
        """The normalized latent ``[s(/tp), b, kv_lora_rank]`` and the RoPE key ``[s, b, 1, d_r]`` (not rotated)."""
        latent, k_pos = torch.split(self.linear_kv_down_proj(hidden), [self.kv_lora_rank, self.pos_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        if self.sequence_parallel:
            k_pos = gather_from_sequence_parallel_region(k_pos, self.tp_group)
        else:
            k_pos = copy_to_tensor_model_parallel_region(k_pos, self.tp_group)
        return latent, k_pos.unsqueeze(2)

    def _expand_kv(self, latent: torch.Tensor, k_pos: torch.Tensor):
        """Keys ``[s, b, heads_r, d_n + d_r]`` and values ``[s, b, heads_r, d_v]`` from the latent and the
        rotated RoPE key (``linear_kv_up_proj`` gathers the latent's sequence under SP)."""
        kv = self.linear_kv_up_proj(latent)
        kv = kv.view(kv.shape[0], kv.shape[1], self.heads_per_rank, self.qk_dim + self.v_dim)
        k_nope, v = torch.split(kv, [self.qk_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pos.expand(-1, -1, self.heads_per_rank, -1)], dim=-1)
        return k, v

    def _rope(self, q: torch.Tensor, k_pos: torch.Tensor, cos, sin):
        q_nope, q_pos = torch.split(q, [self.qk_dim, self.pos_dim], dim=-1)
        if cos is not None:
            q_pos, k_pos = self.rotary_qk(deinterleave(q_pos), deinterleave(k_pos), cos, sin)
        return torch.cat([q_nope, q_pos], dim=-1), k_pos

    # --- the core ----------------------------------------------------------------------------------

    def _core(self, q, k, v, attention_mask):
        """:meth:`SelfAttention.attention_core` with ``v`` padded to q's head dim where the core needs one."""
        if self.q_factor != 1.0:
            q = q * self.q_factor
        pad = self.head_dim - self.v_dim
        one_dim = self.backend != "sdpa" or self.cp_size > 1 or (self.keyed_dropout and self.attention_dropout > 0)
        if one_dim and pad != 0:
            if pad < 0:
                raise ContextParallelError(
                    f"--v-head-dim {self.v_dim} larger than --qk-head-dim + --qk-pos-emb-head-dim {self.head_dim} "
                    f"needs the sdpa attention backend without context parallelism"
                )
            out = self.attention_core(q, k, F.pad(v, (0, pad)), attention_mask)
            s, b = out.shape[:2]
            return out.view(s, b, self.heads_per_rank, self.head_dim)[..., : self.v_dim].reshape(s, b, -1)
        return self.attention_core(q, k, v, attention_mask)

    def _up(self, q_input, latent, k_pos, rotary_cos, rotary_sin):
        """Queries, keys and values from the latents: the up projections and RoPE (recomputed in
        backward with ``--recompute-modules mla_up_proj``)."""
        q, k_pos = self._rope(self._query(q_input), k_pos, rotary_cos, rotary_sin)
        k, v = self._expand_kv(latent, k_pos)
        return q, k, v

    def forward(
        self,
        hidden: torch.Tensor,
        rotary_cos: Optional[torch.Tensor] = None,
        rotary_sin: Optional[torch.Tensor] = None,
        kv_cache=None,
        attention_mask: Optional[torch.Tensor] = None,
    ):
        """As :meth:`SelfAttention.forward`; ``kv_cache`` stores the normalized latent and the rotated
        RoPE key of each position (the compressed cache)."""
        q_input = self._query_input(hidden)
        latent, k_pos = self._compressed_kv(hidden)
        if kv_cache is not None:
            if self.cp_size > 1:
                raise ContextParallelError("generation with a KV cache is not supported under context parallelism")
            q, k_pos = self._rope(self._query(q_input), k_pos, rotary_cos, rotary_sin)
            offset = kv_cache.offset
            latent, k_pos = kv_cache.update(latent, k_pos)
            k, v = self._expand_kv(latent, k_pos)
            if self.q_factor != 1.0:
                q = q * self.q_factor
            return self.linear_proj(self.cached_attention(q, k, v, offset))
        if self.recompute_up:
            q, k, v = checkpoint(self._up, q_input, latent, k_pos, rotary_cos, rotary_sin, rng_tracker=self.rng_tracker)
        else:
            q, k, v = self._up(q_input, latent, k_pos, rotary_cos, rotary_sin)
        if self.recompute_core:
            context = checkpoint(self._core, q, k, v, attention_mask, rng_tracker=self.rng_tracker)
        else:
            context = self._core(q, k, v, attention_mask)
        return self.linear_proj(context)
