"""Parameters held by one rank: which layers its pipeline stage builds and their TP shards.

Counts follow the modules exactly (tests compare with the built model):

* column-parallel weights and biases (QKV, fc1, vocabulary rows) are divided by TP; row-parallel
  weights (proj, fc2) by TP; their biases and the norms are replicated; the QKV bias also with
  ``--add-qkv-bias`` alone, the per-head query and key norms (``--qk-layernorm``) over ``head_dim``;
* the word embedding has the padded vocabulary ``V_pad / TP`` rows on the first stage; the
  output layer has them on the last stage when untied, or, tied, as a copy when the last stage
  has no embedding (PP > 1);
* MoE layers (``--num-experts``): a replicated router ``[E, h]`` and ``E / EP`` experts per rank,
  whole (not split over TP), or split over ``--expert-tensor-parallel-size`` ETP > 1 ranks, counted
  separately as *expert* parameters because the distributed optimizer shards them over the
  expert-data-parallel group instead;
* multi-latent attention (:func:`mla_attention`) and the multi-token prediction depths on the last
  stage (:func:`mtp_parameters`, with the last stage's copy of an untied word embedding under PP);
* vectors (norm weights, biases: 1-D), counted apart for ``--optimizer muon``, whose AdamW takes
  them (with the embeddings and the output layer) while its momentum takes the other matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from megalm.models.layer_split import layers_for_stage, virtual_stages


@dataclass
class StageParameters:
    pp_rank: int
    layers: List[int]
    dense: int  # replicated over data parallel (sharded over DP by the distributed optimizer)
    expert: int  # sharded over the expert-data-parallel group instead
    embedding: int  # part of ``dense`` in embeddings / output layer (for reporting)
    vectors: int = 0  # part of ``dense`` in 1-D parameters (norms, biases)
    expert_vectors: int = 0  # part of ``expert`` in 1-D parameters (the experts' biases)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def _norm(m) -> int:
    return 2 * m.hidden_size if m.normalization == "LayerNorm" else m.hidden_size


def _mlp(m, ffn: int, tp: int) -> int:
    h, bias = m.hidden_size, int(m.add_bias_linear)
    fc1 = (2 * ffn if m.gated_linear_unit else ffn) // tp
    return fc1 * h + bias * fc1 + h * (ffn // tp) + bias * h


def moe_layers(m) -> List[bool]:
    if not m.num_experts:
        return [False] * m.num_layers
    from megalm.transformer.moe.moe_layer import moe_layer_pattern

    return list(moe_layer_pattern(m))


def _qk_norms(m) -> int:
    """``--qk-layernorm``: a query and a key norm over the head dimension (replicated over TP)."""
    return 2 * (2 * m.head_dim if m.normalization == "LayerNorm" else m.head_dim) if m.qk_layernorm else 0


def _latent_norm(m, size: int) -> int:
    return (2 * size if m.normalization == "LayerNorm" else size) if m.qk_layernorm else 0


def mla_attention(m, tp: int) -> tuple:
    """``(parameters, vectors)`` of one multi-latent attention on one rank: replicated down projections
    ``[r_q, h]`` and ``[r_kv + d_r, h]`` and latent norms, column-parallel up projections, row-parallel
    ``linear_proj`` (:mod:`megalm.transformer.mla`)."""
    h, n, bias = m.hidden_size, m.num_attention_heads, int(m.add_bias_linear)
    q_rows = n * (m.qk_head_dim + m.qk_pos_emb_head_dim) // tp
    kv_down, kv_up = m.kv_lora_rank + m.qk_pos_emb_head_dim, n * (m.qk_head_dim + m.v_head_dim) // tp
    if m.q_lora_rank is None:
        params, vectors = (h + bias) * q_rows, bias * q_rows
    else:
        r = m.q_lora_rank
        params = (h + bias) * r + _latent_norm(m, r) + (r + bias) * q_rows
        vectors = bias * (r + q_rows) + _latent_norm(m, r)
    params += (h + bias) * kv_down + _latent_norm(m, m.kv_lora_rank) + (m.kv_lora_rank + bias) * kv_up
    params += h * (n * m.v_head_dim // tp) + bias * h
    vectors += bias * (kv_down + kv_up + h) + _latent_norm(m, m.kv_lora_rank)
    return params, vectors


def layer_parameters(m, tp: int, ep: int, is_moe: bool, etp: int = 1) -> tuple:
    """``(dense, expert)`` parameters of one transformer layer on one rank (experts split over ``etp``)."""
    h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
    groups = m.num_query_groups if m.group_query_attention else n
    bias, qkv_bias = int(m.add_bias_linear), int(m.add_bias_linear or m.add_qkv_bias)
    qkv = (n + 2 * groups) * d // tp
    attention = qkv * h + qkv_bias * qkv + h * (n * d // tp) + bias * h + _qk_norms(m)
    if m.multi_latent_attention:
        attention = mla_attention(m, tp)[0]
    dense = 2 * _norm(m) + attention + (n // tp if m.softmax_type == "learnable" else 0)  # + sinks
    if not is_moe:
        return dense + _mlp(m, m.ffn_hidden_size, tp), 0
    experts = m.num_experts // ep
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    expert = experts * _mlp(m, f, etp)
    dense += m.num_experts * (h + bias)  # the router (its bias as Megatron's: with the linear biases)
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        dense += _mlp(m, shared, tp) + (h if m.moe_shared_expert_gate else 0)
    return dense, expert


def layer_vectors(m, tp: int, ep: int, is_moe: bool, etp: int = 1) -> tuple:
    """``(dense, expert)`` 1-D parameters (norm weights, biases) of one transformer layer on one rank."""
    h, n, d = m.hidden_size, m.num_attention_heads, m.head_dim
    groups = m.num_query_groups if m.group_query_attention else n
    bias, qkv_bias = int(m.add_bias_linear), int(m.add_bias_linear or m.add_qkv_bias)

    def mlp_biases(ffn: int, tp: int) -> int:
        return bias * ((2 * ffn if m.gated_linear_unit else ffn) // tp + h)

    dense = 2 * _norm(m) + qkv_bias * (n + 2 * groups) * d // tp + bias * h + _qk_norms(m)
    if m.multi_latent_attention:
        dense = 2 * _norm(m) + mla_attention(m, tp)[1]
    dense += n // tp if m.softmax_type == "learnable" else 0  # the sink logits, split with the heads
    if not is_moe:
        return dense + mlp_biases(m.ffn_hidden_size, tp), 0
    shared = m.moe_shared_expert_intermediate_size
    dense += mlp_biases(shared, tp) if shared else 0
    dense += bias * m.num_experts  # the router's bias (replicated)
    return dense, m.num_experts // ep * mlp_biases(m.moe_ffn_hidden_size or m.ffn_hidden_size, etp)


def mtp_parameters(m, tp: int, ep: int, etp: int = 1) -> tuple:
    """``(dense, expert, vectors, expert_vectors)`` of the ``--mtp-num-layers`` depths (last stage): per depth
    three norms, ``eh_proj`` ``[h / tp, 2h]`` and a transformer layer like the last decoder layer."""
    is_moe = moe_layers(m)[-1]
    a, b = layer_parameters(m, tp, ep, is_moe, etp)
    c, d = layer_vectors(m, tp, ep, is_moe, etp)
    k = m.mtp_num_layers
    return k * (a + 3 * _norm(m) + 2 * m.hidden_size * m.hidden_size // tp), k * b, k * (c + 3 * _norm(m)), k * d


def stage_parameters(cfg, pp_rank: int) -> StageParameters:
    """Parameters of pipeline rank ``pp_rank`` (all its virtual stages) on one TP/EP rank."""
    m, p = cfg.model, cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or 1
    vpp = virtual_stages(p, m.num_layers) or 1
    layers = [i for v in range(vpp) for i in layers_for_stage(cfg, pp_rank, v)]
    pattern = moe_layers(m)
    dense = expert = vectors = expert_vectors = 0
    for i in layers:
        a, b = layer_parameters(m, tp, ep, pattern[i], etp)
        dense, expert = dense + a, expert + b
        a, b = layer_vectors(m, tp, ep, pattern[i], etp)
        vectors, expert_vectors = vectors + a, expert_vectors + b
    vocab_rows = m.padded_vocab_size // tp
    embedding = 0
    if pp_rank == 0:
        embedding += vocab_rows * m.hidden_size
        if m.position_embedding_type == "learned_absolute":
            embedding += m.max_position_embeddings * m.hidden_size
    if pp_rank == pp - 1:
        dense += _norm(m)
        vectors += _norm(m)
        if m.untie_embeddings_and_output_weights or pp > 1:
            embedding += vocab_rows * m.hidden_size
        if m.mtp_num_layers:
            a, b, c, d = mtp_parameters(m, tp, ep, etp)
            dense, expert, vectors, expert_vectors = dense + a, expert + b, vectors + c, expert_vectors + d
            if pp > 1 and m.untie_embeddings_and_output_weights:  # the last stage's copy of the word embedding
                embedding += vocab_rows * m.hidden_size
    return StageParameters(pp_rank, layers, dense + embedding, expert, embedding, vectors, expert_vectors)


def stage_tensors(cfg, pp_rank: int) -> Optional[List[Tuple[int, bool]]]:
    """``(elements, is 2-D)`` of the parameters of pipeline rank ``pp_rank`` on one TP rank, in the model's order:
    word (and position) embeddings; per layer its input norm, QKV weight, QKV bias and q/k norms, projection and
    its bias, pre-MLP norm, FC1 and its bias, FC2 and its bias (the 1-D parameters of a module as one entry);
    the final norm and the output layer.  None where this does not list the tensors (multi-latent attention,
    MoE, multi-token prediction, learnable softmax sinks)."""
    m, p = cfg.model, cfg.parallel
    if m.multi_latent_attention or m.num_experts or m.mtp_num_layers or m.softmax_type == "learnable":
        return None
    tp, pp, h = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, m.hidden_size
    n, d = m.num_attention_heads, m.head_dim
    groups = m.num_query_groups if m.group_query_attention else n
    bias, qkv_bias = int(m.add_bias_linear), int(m.add_bias_linear or m.add_qkv_bias)
    qkv, fc1 = (n + 2 * groups) * d // tp, (2 if m.gated_linear_unit else 1) * m.ffn_hidden_size // tp
    layer = [(_norm(m), False), (qkv * h, True), (qkv_bias * qkv + _qk_norms(m), False), (h * (n * d // tp), True)]
    layer += [(bias * h, False), (_norm(m), False), (fc1 * h, True), (bias * fc1, False)]
    layer += [(h * (m.ffn_hidden_size // tp), True), (bias * h, False)]
    vocab = (m.padded_vocab_size // tp * h, True)
    out = []
    if pp_rank == 0:
        out.append(vocab)
        if m.position_embedding_type == "learned_absolute":
            out.append((m.max_position_embeddings * h, True))
    out += layer * len(stage_parameters(cfg, pp_rank).layers)
    if pp_rank == pp - 1:
        out.append((_norm(m), False))
        if m.untie_embeddings_and_output_weights or pp > 1:
            out.append(vocab)
    return [t for t in out if t[0]]


def all_stages(cfg) -> List[StageParameters]:
    return [stage_parameters(cfg, r) for r in range(cfg.parallel.pipeline_model_parallel_size)]


def total_parameters(cfg) -> int:
    """The whole model's parameters (unsharded, padded vocabulary, one copy of a tied embedding)."""
    m = cfg.model
    pattern = moe_layers(m)
    total = sum(sum(layer_parameters(m, 1, 1, pattern[i])) for i in range(m.num_layers)) + _norm(m)
    if m.mtp_num_layers:
        total += sum(mtp_parameters(m, 1, 1)[:2])
    total += m.padded_vocab_size * m.hidden_size * (2 if m.untie_embeddings_and_output_weights else 1)
    if m.position_embedding_type == "learned_absolute":
        total += m.max_position_embeddings * m.hidden_size
    return total
