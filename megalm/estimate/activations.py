"""Activation memory: the bytes autograd keeps per microbatch, and how many microbatches are in flight.

Counted from what megalm's modules save for backward (tests measure the forward's saved
tensors with ``torch.autograd.graph.saved_tensors_hooks`` and compare), with ``S = s b`` tokens
of a microbatch, ``S_r = S / TP`` under sequence parallelism (else ``S``), ``B`` the model
dtype's bytes, ``n`` heads, ``g`` query groups, ``d`` head dim, ``f`` FFN width, per layer:

==============================  =====================================================================
norms (x2)                      fp32 copy of the input ``4 S_r h`` + stats (LayerNorm mean/rstd, RMSNorm
                                rstd, ``4 S_r`` each); RMSNorm on CPU (composite kernel) also keeps the
                                normalized input ``4 S_r h``; half precision also fp32 weight copies
linear inputs (QKV, fc1)        ``B S_r h`` each (under SP the local slice; gathered again in backward)
fused QKV output                ``B S (n + 2g) d / TP`` (kept by the attention core's k/v views)
RoPE                            rotated q and k ``B S (n + g) d / TP`` (+ small cos/sin tables)
attention core (flash/SDPA)     output ``B S n d / TP`` + log-sum-exp ``4 b n s / TP``; the
                                ``[s, b, n d]`` context copy for ``linear_proj`` ``B S n d / TP`` (on CPU
                                SDPA returns the output in that layout already: one tensor); selective
                                recompute keeps only the context
attention core (blocked)        the context ``B S n d / TP`` + each query block's probabilities,
                                ``B b n s (s + 64) / 2 / TP``; with GQA k and v expanded to ``n`` heads
                                ``2 B S n d / TP`` (with RoPE the QKV output and the rotated k are then
                                not kept)
attention core (SDPA with       ``--attention-dropout > 0`` on a CPU: SDPA's math path, in fp32: scaled q
attention dropout, CPU)         and k^T copies, the probabilities, dropout mask and dropped probabilities
                                (``4 b n s^2 / TP`` each), v (an fp32 copy; fp32 MHA: the QKV output's view)
                                and the context copy (:func:`sdpa_math_bytes`)
attention core (gpt-oss)        blocked: a windowed layer's block ``[r0, r1)`` keeps ``r1 - max(0, r0 - w)``
                                keys' probabilities, plus a sink column (:func:`blocked_probability_bytes`);
                                other plans run SDPA: a window adds its ``[s, s]`` mask, sinks take the math
                                path (:func:`variant_core_bytes`)
attention core (unfused)        fp32 softmax output ``4 b n s^2 / TP`` + bool causal mask, the model-dtype
                                probabilities (dropout: mask and dropped ones) and the context copy
                                (:func:`unfused_core_bytes`)
attention core (position-       the tiled core (:func:`tiled_core_bytes`, the ring's at CP 1): q, k/v copies
keyed dropout)                  ``2 B S g d / TP``, output, fp32 log-sum-exps and the context copy
MLP                             GELU ``2 B S f / TP`` (fc1 output, GELU output); SwiGLU ``4 B S f / TP``
dropout masks                   ``S_r h`` elements each after attention and MLP when ``--hidden-dropout > 0``
                                (bool on CUDA; the activation dtype on CPU)
==============================  =====================================================================

First stage: token ids (int64) and the embedding dropout mask.  Last stage: final norm,
output-layer input, and what the loss keeps: with the fused output layer + cross entropy (the
default) the gradients it computes in forward, ``B S h`` for the input and an fp32 ``4 V_pad h / TP``
for the weight (plus fp32 token weights and int64 targets); unfused, the cross entropy's fp32
softmax ``4 S V_pad / TP``.  Full recompute
keeps only each recomputed chunk's input ``B S_r h`` and rebuilds one chunk during backward.
Activation offloading (``--cpu-offloading``) keeps the saved tensors of the chunk's first
``--cpu-offloading-num-layers`` layers on the host: the device keeps the rest.  Backward brings them back
one layer ahead (while layer ``i``'s backward runs, layer ``i - 1`` is reloaded), which the kept count does
not add: with ``N`` offloaded layers of ``L`` the layers above have been freed by then, except with
``N = L - 1``, where the last layer's backward holds itself and the reloaded layer below (the loss's
tensors, freed by then, usually outweigh that layer).
MoE layers are estimated (not measured): router scores and the top-k copies of the tokens
through the experts.  Multi-latent attention replaces the QKV / RoPE / core rows (:func:`mla_bytes`); the
multi-token prediction depths add to the last stage (:func:`mtp_bytes`); both measured within 5%.

Context parallelism (``CP > 1``): every count above is per rank, with ``S = s b / CP`` and
``s / CP`` positions; the attention core keeps, by ``--cp-comm-type`` (:func:`context_parallel_attention_bytes`):
p2p the ring's q, contiguous k/v copies ``2 B S g d / TP``, output, log-sum-exps ``B b n s / CP / TP``
and the context copy; a2a the all-to-all'd q/k/v (the QKV output's size) and, by the layer's core on the
whole sequence of ``n / CP`` heads, SDPA's output, fp32 log-sum-exps and the context copy, or the blocked
core's probabilities (``1/CP`` of the table's) and context; allgather the gathered k/v ``2 B s b g d / TP``, output,
log-sum-exps, masks (SDPA keeps them in the model dtype) and the context copy (with attention dropout,
position-keyed under CP: per chunk contiguous copies of the keys and values it sees, no mask); a2a and
allgather also keep the int64 indices that reorder chunks.  Measured on 2 ranks: equal without attention
dropout, 0.25% under with it (the keyed dropout's key and position tensors are not counted) (tests/test_estimate.py).

Packed sequences (``--qkv-format thd``, ``Shape.packed``), with the SDPA / flash-attn core: no ``[b, 1, s, s]``
mask; the core keeps packed copies of q, k, v instead of the QKV output and rotated q and k, its outputs and
the context copy (:func:`packed_attention_bytes`), and the RoPE tables are per row (positions restart in every
document).  Measured equal on a CPU (GPT and Llama-style GQA, fp32 and bf16).  Under CP (:func:`runs_varlen`):
a2a runs that core on the whole sequence of ``n / CP`` heads (the same rows per rank); p2p's ring and the
position-keyed dropout cores (every type's with attention dropout under CP) keep their causal forms' tensors
plus each layer's int64 ``[b, s]`` document ids (:func:`document_id_bytes`; the ring's per-tile document masks
are freed within its forward and backward); allgather's per-chunk masks hold one document mask per row
(``b`` times the causal ones).  Measured on 2 ranks: equal (with attention dropout 0.25% under: the keyed
dropout's key and position tensors, a few hundred bytes per layer, are not counted).  The
other cores at CP 1 and selective recompute under THD are counted as their causal forms (not measured).

In flight (Megatron's schedules): no pipelining 1 microbatch; 1F1B stage ``r`` of ``p`` holds
``min(p - r, m)``; interleaved with ``v`` chunks ``min(2 (p - r - 1) + (v - 1) p + 1, m v)``
chunk-microbatches, i.e. ``L/p (1 + (p-1)/(p v))`` layers' worth on the first stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megalm.config.gptoss import layer_window, uses_sinks
from megalm.estimate.parameters import moe_layers
from megalm.fusions.backends import uses_blocked_attention
from megalm.models.layer_split import layers_for_stage, virtual_stages
from megalm.tensor_parallel.linear_cross_entropy import chunk_rows
from megalm.transformer.blocked_attention import block_ranges


@dataclass
class Shape:
    """What activations depend on: microbatch shape, layout, precision and kernels."""

    seq: int
    micro_batch: int
    tp: int
    sequence_parallel: bool
    dtype_bytes: int
    device: str = "cuda"  # "cuda" or "cpu": which kernels' saved tensors to count
    cp: int = 1  # context-parallel size: each rank holds seq / cp positions
    cp_comm_type: str = "p2p"
    packed: bool = False  # --qkv-format thd: per-document attention on packed copies, no s x s mask

    @property
    def local_seq(self) -> int:
        """Positions of the sequence this rank holds (all of them without context parallelism)."""
        return self.seq // self.cp

    @property
    def tokens(self) -> int:
        return self.local_seq * self.micro_batch

    @property
    def local_tokens(self) -> int:
        return self.tokens // self.tp if self.sequence_parallel else self.tokens


def norm_bytes(m, sh: Shape, size: Optional[int] = None) -> int:
    h, t = size or m.hidden_size, sh.local_tokens
    half = sh.dtype_bytes < 4
    if m.normalization == "LayerNorm":
        return 4 * t * h + 8 * t + (8 * h if half else 0)
    kept = 4 * t * h + 4 * t + (4 * h if half else 0)
    return kept + (4 * t * h if sh.device == "cpu" else 0)


def mla_bytes(m, sh: Shape) -> Dict[str, int]:
    """Multi-latent attention's saved bytes (:mod:`megalm.transformer.mla`), measured on a CPU: the latents'
    norms (their fp32 input copy, stats and normalized output, as :func:`norm_bytes` over the latent width;
    the down projection's output is what the key/value norm keeps), the up projections' inputs in half
    precision, the cos/sin tables, the concatenated q and k ``2 B S n d_q / TP``, the key/value up
    projection's output ``B S n (d_n + d_v) / TP`` (v is a view of it), SDPA's math path (the value dim
    differs) with its fp32 probabilities ``4 b n s^2 / TP``, and the context ``B S n d_v / TP``.  Selective
    recompute of ``core_attn`` drops the probabilities; ``mla_up_proj`` drops q, k and the up output."""
    B, S, Sr, tp = sh.dtype_bytes, sh.tokens, sh.local_tokens, sh.tp
    n, dq, dv = m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
    half = B < 4
    out = {"latents": 0}
    for rank in ([m.q_lora_rank] if m.q_lora_rank else []) + [m.kv_lora_rank]:
        out["latents"] += (norm_bytes(m, sh, rank) if m.qk_layernorm else 0) + (B * Sr * rank if half else 0)
    if half or not m.qk_layernorm:  # the key/value norm's input is then not the down projection's output
        out["latents"] += B * Sr * (m.kv_lora_rank + m.qk_pos_emb_head_dim)
    else:  # its input is a view of that output, which also holds the RoPE key
        out["latents"] += 4 * Sr * m.qk_pos_emb_head_dim
    out["rope"] = 2 * 4 * sh.local_seq * m.qk_pos_emb_head_dim
    recompute = set(m.recompute_modules or ("core_attn",)) if m.recompute_granularity == "selective" else set()
    if "mla_up_proj" not in recompute:
        out["qkv"] = B * S * n * (2 * dq + m.qk_head_dim + dv) // tp
    probs = 0 if "core_attn" in recompute else 4 * sh.micro_batch * n * sh.seq * sh.seq // tp
    out["attention"] = B * S * n * dv // tp + probs
    return out


def layer_bytes(m, sh: Shape, is_moe: bool = False, layer_number: int = 0) -> Dict[str, int]:
    """Saved bytes of one transformer layer (0-based global ``layer_number``: its sliding window) for one
    microbatch, by part."""
    B, S, tp, h = sh.dtype_bytes, sh.tokens, sh.tp, m.hidden_size
    n, d = m.num_attention_heads, m.head_dim
    g = m.num_query_groups if m.group_query_attention else n
    out = {
        "norms": 2 * norm_bytes(m, sh),
        "linear_inputs": B * sh.local_tokens * h * (1 if is_moe else 2),
        "qkv": B * S * (n + 2 * g) * d // tp,
    }
    if m.multi_latent_attention:
        del out["qkv"]
        out.update(mla_bytes(m, sh))
    elif m.position_embedding_type in ("rope", "yarn"):
        rot = int(d * m.rotary_percent)
        tables = 4 * sh.local_seq * rot * B * (sh.micro_batch if sh.packed else 1) if B < 4 else 0
        # the varlen core reads packed copies of q, k, v (the qkv row), so the rotated q and k are let go
        out["rope"] = (0 if runs_varlen(m, sh) else B * S * (n + g) * d // tp) + tables
    context = B * S * n * d // tp
    window, sinks = layer_window(m, layer_number), uses_sinks(m)
    variant = window is not None or sinks
    blocked = uses_blocked_attention(m, sh.dtype_bytes < 4, sh.device == "cuda")
    if m.multi_latent_attention:
        pass  # mla_bytes above
    elif m.recompute_granularity == "selective":
        out["attention"] = context
    elif sh.cp > 1:
        out.update(context_parallel_attention_bytes(m, sh, out))
    elif m.attention_dropout > 0 and m.position_keyed_attention_dropout:
        out.update(tiled_core_bytes(m, sh, out))  # the position-keyed core (blocks.local_attention)
        out["attention"] += document_id_bytes(sh)
    elif variant and not blocked:
        out.update(variant_core_bytes(m, sh, out, window, sinks))
    elif m.attention_backend == "unfused":
        out.update(unfused_core_bytes(m, sh, out))
    elif m.attention_dropout > 0 and sh.device == "cpu":
        out.update(sdpa_math_bytes(m, sh, out))
    elif blocked:
        out["attention"] = context + blocked_probability_bytes(m, sh, window, sinks)
        if g != n:  # k and v are kept expanded to n heads instead of the projections' own
            out["attention"] += 2 * context
            if "rope" in out:  # q is the rotated copy; the QKV output and the rotated k are let go
                out["qkv"] = 0
                out["rope"] -= B * S * g * d // tp
    elif sh.packed:  # packed_attention_bytes: the per-document outputs and the context copy
        out.update(packed_attention_bytes(m, sh, out))
    else:
        lse = 4 * sh.micro_batch * sh.seq * n // tp
        out["attention"] = context * (1 if sh.device == "cpu" else 2) + lse
    if is_moe:
        out["moe"] = moe_bytes(m, sh)
    else:
        out["mlp"] = B * S * m.ffn_hidden_size // tp * (4 if m.gated_linear_unit else 2)
    if m.hidden_dropout > 0:
        out["dropout_masks"] = 2 * sh.local_tokens * h * mask_bytes(sh)
    return out


def runs_varlen(m, sh: Shape) -> bool:
    """Whether ``--qkv-format thd`` attention runs the varlen core (:mod:`megalm.transformer.varlen_attention`,
    on packed copies of q, k, v): in one process, and as a2a's core on the whole sequence, unless the
    position-keyed dropout core (always the one under CP) runs instead."""
    keyed = m.attention_dropout > 0 and (m.position_keyed_attention_dropout or sh.cp > 1)
    return sh.packed and not keyed and (sh.cp == 1 or sh.cp_comm_type == "a2a")


def document_id_bytes(sh: Shape) -> int:
    """``--qkv-format thd`` with a core that masks documents by id (the p2p ring, the position-keyed dropout
    cores): each layer's int64 ``[b, s]`` document ids of the whole sequence
    (:func:`~megalm.transformer.packed_seq.document_ids`), which its core keeps for backward (0 unpacked)."""
    return 8 * sh.micro_batch * sh.seq if sh.packed else 0


def packed_attention_bytes(m, sh: Shape, parts: Dict[str, int]) -> Dict[str, int]:
    """``--qkv-format thd`` (:mod:`megalm.transformer.varlen_attention`) with the SDPA / flash-attn core: q, k
    and v are copied to packed ``[t, heads, d]`` tensors, which the core keeps (``B S (n + 2g) d / TP``, the
    ``qkv`` row; the QKV output and the rotated q and k are then let go), its outputs (per document on a CPU,
    flash-attn's one on CUDA) ``B S n d / TP`` and fp32 log-sum-exps ``4 b n s / TP``, and the ``[s, b, n d]``
    context copy for ``linear_proj``.  No ``[b, 1, s, s]`` mask: the cost of the documents is nothing
    beyond the causal core's one extra output copy.  Under a2a context parallelism the same core runs on the
    whole sequence of ``n / CP`` heads: the same bytes per rank, with ``S = s b / CP``."""
    n = m.num_attention_heads
    context = sh.dtype_bytes * sh.tokens * n * m.head_dim // sh.tp
    return {"attention": 2 * context + 4 * sh.micro_batch * sh.local_seq * n // sh.tp}


def tiled_core_bytes(m, sh: Shape, parts: Dict[str, int]) -> Dict[str, int]:
    """The tiled cores of :mod:`megalm.context_parallel.blocks` (the ring of ``--cp-comm-type p2p``; without
    CP the position-keyed dropout core) on this rank's ``S`` tokens: q, contiguous k and v copies, the output
    and fp32 log-sum-exps, then the ``[s, b, n d]`` context copy; with RoPE q is the rotated copy and neither
    the QKV output nor the rotated k is kept (``parts``: the layer's other parts, "qkv" / "rope" replaced)."""
    B, S, tp, b = sh.dtype_bytes, sh.tokens, sh.tp, sh.micro_batch
    n, d = m.num_attention_heads // tp, m.head_dim
    g = (m.num_query_groups if m.group_query_attention else m.num_attention_heads) // tp
    out = {"attention": 2 * B * S * n * d + 2 * B * S * g * d + 4 * b * n * sh.local_seq}
    if "rope" in parts:
        out["qkv"], out["rope"] = 0, parts["rope"] - B * S * g * d
    return out


def unfused_core_bytes(m, sh: Shape, parts: Dict[str, int]) -> Dict[str, int]:
    """``--attention-backend unfused`` (eager): the fp32 softmax output ``4 b n s^2 / TP`` and its bool causal
    mask ``s^2``; the probabilities the last matmul reads in the model dtype (a copy in half precision), or with
    attention dropout its mask and the dropped probabilities (``B b n s^2 / TP`` each); the context copy; under
    GQA k and v expanded to ``n`` heads (with RoPE the QKV output and the rotated k are then not kept)."""
    B, S, tp, b, s = sh.dtype_bytes, sh.tokens, sh.tp, sh.micro_batch, sh.seq
    n, d = m.num_attention_heads // tp, m.head_dim
    g = (m.num_query_groups if m.group_query_attention else m.num_attention_heads) // tp
    probs = b * n * s * s
    read = 2 * B * probs if m.attention_dropout > 0 else (B * probs if B < 4 else 0)
    out = {"attention": 4 * probs + s * s + read + B * S * n * d}
    if g != n:
        out["attention"] += 2 * B * S * n * d
        if "rope" in parts:
            out["qkv"], out["rope"] = 0, parts["rope"] - B * S * g * d
    return out


def sdpa_math_bytes(m, sh: Shape, parts: Dict[str, int]) -> Dict[str, int]:
    """SDPA with attention dropout on a CPU (its math path, no fused kernel, computing in fp32 whatever the
    model dtype): scaled copies of q and k^T, the probabilities, the dropout mask and the dropped
    probabilities (``4 b n s s / TP`` each), v (fp32: a copy, expanded to ``n`` heads under GQA, and the QKV
    output let go; fp32 MHA: a view that keeps the QKV output), then the context copy in the model dtype;
    with RoPE the rotated q and k are not kept (``parts``: the layer's other parts, "qkv" / "rope" replaced)."""
    B, S, tp, b, s = sh.dtype_bytes, sh.tokens, sh.tp, sh.micro_batch, sh.seq
    n, d = m.num_attention_heads // tp, m.head_dim
    g = (m.num_query_groups if m.group_query_attention else m.num_attention_heads) // tp
    out = {"attention": 3 * 4 * b * n * s * s + 2 * 4 * S * n * d + B * S * n * d}
    if g != n or B < 4:
        out["attention"] += 4 * S * n * d
        out["qkv"] = 0
    if "rope" in parts:
        out["rope"] = parts["rope"] - B * S * (n + g) * d
    return out


def context_parallel_attention_bytes(m, sh: Shape, parts: Dict[str, int]) -> Dict[str, int]:
    """The attention core's saved bytes under context parallelism (``S`` this rank's ``s b / CP``
    tokens; ``parts`` the layer's other parts so far, whose "qkv" / "rope" entries it may replace)."""
    B, S, tp, b = sh.dtype_bytes, sh.tokens, sh.tp, sh.micro_batch
    n, d = m.num_attention_heads // tp, m.head_dim
    g = (m.num_query_groups if m.group_query_attention else m.num_attention_heads) // tp
    context = B * S * n * d
    if sh.cp_comm_type == "p2p":  # the ring also keeps the documents' ids (its blocks' masks are per tile, freed)
        out = tiled_core_bytes(m, sh, parts)
        out["attention"] += document_id_bytes(sh)
        return out
    # a2a reorders q, k, v and the output between rank and sequence order, allgather k and v: each indexing
    # keeps its int64 index of the 2 CP chunks (chunks.gathered_to_global) for backward
    reorder = (4 if sh.cp_comm_type == "a2a" else 2) * 8 * 2 * sh.cp
    if runs_varlen(m, sh):  # a2a with packed documents: the varlen core on n / CP heads
        out = packed_attention_bytes(m, sh, parts)
        out["attention"] += reorder
        return out
    out = {}
    if sh.cp_comm_type == "allgather" and "rope" in parts:
        # q is the rotated copy, k and v are gathered: neither the QKV output nor the rotated k is kept.
        out["qkv"], out["rope"] = 0, parts["rope"] - B * S * g * d
    if sh.cp_comm_type == "a2a":
        # The layer's core on the whole sequence of n / CP heads keeps the all-to-all'd q, k, v (the QKV
        # output's size); the rotated q and k are not kept.  SDPA: its output and fp32 log-sum-exps, then the
        # context copy; blocked (``auto`` picks it at these lengths on a CPU): each query block's
        # probabilities, the context, and under GQA k and v expanded to n / CP heads instead of their own.  With
        # attention dropout the core is the keyed one (blocks.local_attention), whose saved tensors are SDPA's.
        if m.attention_dropout == 0 and uses_blocked_attention(m, B < 4, sh.device == "cuda"):
            out["attention"] = context + blocked_probability_bytes(m, sh) // sh.cp
            if g != n:
                out["attention"] += 2 * context
                out["qkv"] = parts["qkv"] - 2 * B * S * g * d
        else:  # the keyed core with packed documents also keeps their ids
            out["attention"] = 2 * context + 4 * b * n * sh.local_seq + document_id_bytes(sh)
        if "rope" in parts:
            out["rope"] = parts["rope"] - B * S * (m.num_attention_heads + g * tp) * d // tp
    elif m.attention_dropout > 0:
        # The keyed core (blocks.local_attention) per query chunk j: contiguous copies of the ``(j + 1) c``
        # keys and values it sees (``(2 CP + 1) c`` for the rank's pair), its output and log-sum-exps; no mask.
        # With packed documents the chunks' cores also keep (views of) the documents' ids.
        c = sh.local_seq // 2
        out["attention"] = 2 * context + 2 * B * b * (2 * sh.cp + 1) * c * g * d + 4 * b * n * sh.local_seq
        out["attention"] += document_id_bytes(sh)
    else:
        # Gathered k and v of the whole sequence, each query chunk's output, log-sum-exps and causal
        # mask (``c x (j + 1) c`` for chunk j: ``c^2 (2 CP + 1)`` for the rank's pair), which SDPA keeps
        # converted from bool to the model dtype; with packed documents the mask also holds the document
        # mask, one per row: ``b`` times that.
        c = sh.local_seq // 2
        mask = B * c * c * (2 * sh.cp + 1) * (b if sh.packed else 1)
        out["attention"] = 2 * context + 2 * B * S * sh.cp * g * d + 4 * b * n * sh.local_seq + mask
    out["attention"] += reorder
    return out


def blocked_probability_bytes(m, sh: Shape, window: Optional[int] = None, sinks: bool = False) -> int:
    """What the blocked attention keeps per layer: query block ``[r0, r1)`` keeps ``[b, n/tp, r1 - r0, r1 - k0]``,
    ``k0`` its first visible key (0, or ``r0 - window`` with a sliding window), plus one sink column."""
    rows = sum((end - start) * (end - max(0, start - (window or start)) + sinks) for start, end in block_ranges(sh.seq))
    return sh.dtype_bytes * sh.micro_batch * (m.num_attention_heads // sh.tp) * rows


def variant_core_bytes(m, sh: Shape, parts: Dict[str, int], window: Optional[int], sinks: bool) -> Dict[str, int]:
    """gpt-oss's SDPA core (:func:`megalm.fusions.attention_variants.variant_attention`, every plan but the blocked
    one) on a CPU.  A window alone: SDPA's kernel keeps the ``[s, s]`` mask (as the model dtype), its output and
    fp32 log-sum-exps as without one.  Sinks: a float mask that needs a gradient sends SDPA down its math path, which
    keeps fp32 copies of the scaled q, of k^T and v with the sink's zero row (expanded to ``n`` heads), and the
    fp32 probabilities ``[b, n, s, s + 1]``; the QKV output and the rotated q and k are then not kept."""
    B, S, tp, b, s = sh.dtype_bytes, sh.tokens, sh.tp, sh.micro_batch, sh.seq
    n, d = m.num_attention_heads // tp, m.head_dim
    g = (m.num_query_groups if m.group_query_attention else m.num_attention_heads) // tp
    context = B * S * n * d
    if not sinks:
        return {"attention": context + 4 * b * n * s + B * s * s}
    out = {"attention": 4 * S * n * d + 2 * 4 * b * n * (s + 1) * d + 4 * b * n * s * (s + 1) + context, "qkv": 0}
    if "rope" in parts:
        out["rope"] = parts["rope"] - B * S * (n + g) * d
    return out


def mask_bytes(sh: Shape) -> int:
    """Bytes per element of a saved dropout mask: bool on CUDA, the activation dtype on CPU."""
    return sh.dtype_bytes if sh.device == "cpu" else 1


def moe_bytes(m, sh: Shape) -> int:
    """Estimate of an MoE block: router scores, top-k token copies through the experts' MLPs."""
    B, h, k, E = sh.dtype_bytes, m.hidden_size, m.moe_router_topk, m.num_experts
    t = sh.tokens // sh.tp  # each TP rank routes its own slice of the sequence
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    router = B * t * h + 3 * 4 * t * E
    routed = k * t * (2 * B * h + B * f * (4 if m.gated_linear_unit else 2))
    shared = m.moe_shared_expert_intermediate_size or 0
    return router + routed + B * t * (h + shared * (4 if m.gated_linear_unit else 2))


def embedding_bytes(m, sh: Shape) -> int:
    """First stage: token ids (and masks of the vocabulary-parallel lookup), embedding dropout mask."""
    ids = 8 * sh.tokens + (sh.tokens if sh.tp > 1 else 0)
    if m.position_embedding_type == "learned_absolute":
        ids += 8 * sh.local_seq
    elif m.position_embedding_type == "rope" and sh.dtype_bytes == 4:  # fp32 cos/sin tables, shared by layers
        ids += 2 * 4 * sh.local_seq * int(m.head_dim * m.rotary_percent) * (sh.micro_batch if sh.packed else 1)
    return ids + (sh.local_tokens * m.hidden_size * mask_bytes(sh) if m.hidden_dropout > 0 else 0)


def output_bytes(m, sh: Shape) -> int:
    """Last stage: final norm, output-layer input, and the loss's saved tensors (see the module docstring)."""
    vocab = m.padded_vocab_size // sh.tp
    kept = norm_bytes(m, sh) + sh.dtype_bytes * sh.local_tokens * m.hidden_size
    if m.cross_entropy_loss_fusion:
        return kept + sh.dtype_bytes * sh.tokens * m.hidden_size + 4 * vocab * m.hidden_size + 12 * sh.tokens
    return kept + 4 * sh.tokens * vocab + 9 * sh.tokens + (vocab if m.padded_vocab_size != m.vocab_size else 0)


def logits_transient_bytes(m, sh: Shape) -> int:
    """Alive during the loss only: the fused loss's logits chunk (fp32, plus a copy in the model
    dtype) and, under sequence parallelism, the gathered input; else the logits in the model
    dtype next to the fp32 softmax."""
    vocab = m.padded_vocab_size // sh.tp
    if m.cross_entropy_loss_fusion:
        rows = chunk_rows(sh.tokens, vocab, torch.device(sh.device))
        gathered = sh.dtype_bytes * sh.tokens * m.hidden_size if sh.sequence_parallel and sh.tp > 1 else 0
        return (4 + (sh.dtype_bytes if sh.dtype_bytes != 4 else 0)) * rows * vocab + gathered
    return sh.dtype_bytes * sh.tokens * vocab


def chunk_bytes(m, sh: Shape, layers, pre_process: bool, post_process: bool) -> Dict[str, int]:
    """``{"kept", "recompute_peak"}`` for one model chunk and one microbatch, with recompute applied."""
    pattern = moe_layers(m)
    full = [sum(layer_bytes(m, sh, pattern[i], i).values()) for i in layers]
    hidden_in = sh.dtype_bytes * sh.local_tokens * m.hidden_size
    kept, peak = sum(full), 0
    if m.recompute_granularity == "full" and layers:
        n = m.recompute_num_layers
        if m.recompute_method == "uniform":
            groups = [full[i : i + n] for i in range(0, len(full), n)]
            kept = hidden_in * len(groups)
            peak = max(sum(gr) for gr in groups)
        else:  # block: the first n layers of the chunk are recomputed one by one
            kept = hidden_in * min(n, len(full)) + sum(full[n:])
            peak = max(full[:n]) if full[:n] else 0
    if m.cpu_offloading:
        kept -= sum(full[: m.cpu_offloading_num_layers])
    if pre_process:
        kept += embedding_bytes(m, sh)
    if post_process:
        kept += output_bytes(m, sh) + mtp_bytes(m, sh)
    return {"kept": kept, "recompute_peak": peak}


def mtp_bytes(m, sh: Shape) -> int:
    """``--mtp-num-layers`` depths (last stage): per depth a layer like the last decoder layer, ``enorm`` and
    ``hnorm``, ``eh_proj``'s input ``2 B S_r h`` and, as :func:`output_bytes`, the final norm, output layer and loss."""
    if not m.mtp_num_layers:
        return 0
    eh_input = 2 * sh.dtype_bytes * sh.local_tokens * m.hidden_size
    per_depth = 2 * norm_bytes(m, sh) + eh_input + output_bytes(m, sh)
    # depth k's layer is global layer num_layers + k (its window); MoE or dense as the last decoder layer
    layers = sum(sum(layer_bytes(m, sh, moe_layers(m)[-1], m.num_layers + k).values()) for k in range(m.mtp_num_layers))
    return layers + m.mtp_num_layers * per_depth


def in_flight(pp: int, pp_rank: int, num_microbatches: int, vpp: int = 1) -> float:
    """Microbatches whose activations pipeline rank ``pp_rank`` holds at its peak (chunk-microbatches / v)."""
    if pp == 1:
        return 1
    if vpp > 1:
        return min(2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1, num_microbatches * vpp) / vpp
    return min(pp - pp_rank, num_microbatches)


def stage_activation_bytes(cfg, pp_rank: int, sh: Shape, num_microbatches: int) -> Dict[str, float]:
    """Per-microbatch bytes of this pipeline rank, microbatches in flight, and the peak activation bytes."""
    m, p = cfg.model, cfg.parallel
    pp = p.pipeline_model_parallel_size
    vpp = virtual_stages(p, m.num_layers) or 1
    per_micro, recompute_peak = 0, 0
    for v in range(vpp):
        c = chunk_bytes(
            m, sh, layers_for_stage(cfg, pp_rank, v), pp_rank == 0 and v == 0, pp_rank == pp - 1 and v == vpp - 1
        )
        per_micro += c["kept"]
        recompute_peak = max(recompute_peak, c["recompute_peak"])
    flight = in_flight(pp, pp_rank, num_microbatches, vpp)
    transient = recompute_peak + (logits_transient_bytes(m, sh) if pp_rank == pp - 1 else 0)
    return {"per_microbatch": per_micro, "in_flight": flight, "activations": per_micro * flight, "transient": transient}
