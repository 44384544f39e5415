"""Checkpoint names and full shapes of a multi-latent-attention layer (DeepSeek-V2/V3), shared by the
generic shape table (:mod:`megalm.conversion.base`) and the DeepSeek-V3 mapping."""

from __future__ import annotations

from typing import Dict

ATTN = "self_attention."


def mla_attention_shapes(m) -> Dict[str, tuple]:
    """Layer-relative names and full shapes of an MLA layer's attention weights."""
    n, h = m.num_attention_heads, m.hidden_size
    q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
    shapes = {}
    if m.q_lora_rank is None:
        shapes[ATTN + "linear_q_proj"] = (n * q_head, h)
    else:
        shapes[ATTN + "linear_q_down_proj"] = (m.q_lora_rank, h)
        shapes[ATTN + "linear_q_up_proj"] = (n * q_head, m.q_lora_rank)
    shapes[ATTN + "linear_kv_down_proj"] = (m.kv_lora_rank + m.qk_pos_emb_head_dim, h)
    shapes[ATTN + "linear_kv_up_proj"] = (n * (m.qk_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes[ATTN + "linear_proj"] = (h, n * m.v_head_dim)
    return shapes


def mla_norm_shapes(m) -> Dict[str, tuple]:
    """Layer-relative names and shapes of an MLA layer's latent norms (``--qk-layernorm``)."""
    if not m.qk_layernorm:
        return {}
    shapes = {ATTN + "kv_layernorm": (m.kv_lora_rank,)}
    if m.q_lora_rank is not None:
        shapes[ATTN + "q_layernorm"] = (m.q_lora_rank,)
    return shapes
