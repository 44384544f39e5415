"""What every architecture mapping provides, and megalm's tensor layouts it builds on.

megalm's global parameter names (the checkpoint keys)::

    embedding.word_embeddings.weight            [V, h]   (unpadded vocabulary)
    embedding.position_embeddings.weight        [P, h]   (learned positions only)
    decoder.layers.{i}.input_layernorm.{weight,bias}
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}   [(n + 2g) d, h]
    decoder.layers.{i}.self_attention.linear_proj.{weight,bias}  [h, n d]
    decoder.layers.{i}.self_attention.{q,k}_layernorm.{weight,bias}  [d]  (--qk-layernorm only)
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}   [f, h], SwiGLU [2, f, h] = [gate; up]
    decoder.layers.{i}.mlp.linear_fc2.{weight,bias}   [h, f]
    MoE layers instead of mlp.linear_fc*  (E experts, expert hidden size F; global expert index j):
    decoder.layers.{i}.mlp.router.weight                                   [E, h]
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.{weight,bias}  [F, h], SwiGLU [2F, h] = [gate; up]
    decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.{weight,bias}  [h, F]
    decoder.layers.{i}.mlp.shared_experts.linear_fc{1,2}.{weight,bias}    (as a dense MLP)
    decoder.final_layernorm.{weight,bias}
    output_layer.weight                               [V, h]   (untied only)

The fused QKV rows are grouped per query group ``g``: ``[q heads of group g ; k_g ; v_g]``
(:func:`split_qkv` / :func:`merge_qkv`).  Query head ``j`` of group ``g`` is head
``g * n/G + j``, which is the order Hugging Face's grouped attention (``repeat_kv``) uses.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Iterator, List, Tuple

import torch

from megalm.conversion.errors import ConversionError
from megalm.conversion.mla_shapes import mla_attention_shapes, mla_norm_shapes

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm"
OUTPUT_LAYER = "output_layer.weight"
VOCAB_ROWS = (WORD_EMBEDDINGS, OUTPUT_LAYER)

NamedTensors = Iterator[Tuple[str, torch.Tensor]]
LoadFn = Callable[[Iterable[str]], Dict[str, torch.Tensor]]


def layer(i: int, suffix: str) -> str:
    return f"decoder.layers.{i}.{suffix}"


ROUTER = "mlp.router.weight"


def expert(j: int, suffix: str) -> str:
    """Layer-relative name of global expert ``j``'s parameter ``suffix`` (e.g. ``linear_fc1.weight``)."""
    return f"mlp.experts.local_experts.{j}.{suffix}"


def moe_layers(m) -> List[bool]:
    """For each layer of megalm model config ``m``, whether it is a mixture-of-experts layer."""
    from megalm.transformer.moe.moe_layer import moe_layer_pattern

    return moe_layer_pattern(m)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int):
    """megalm's grouped ``[G (n/G + 2) d, ...]`` -> ``q [n d, ...]``, ``k [G d, ...]``, ``v [G d, ...]``."""
    per_group = num_heads // num_groups
    expected = (num_heads + 2 * num_groups) * head_dim
    if qkv.shape[0] != expected:
        raise ConversionError(
            f"fused QKV tensor has {qkv.shape[0]} rows, expected (heads {num_heads} + 2 x groups "
            f"{num_groups}) x head dim {head_dim} = {expected}"
        )
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(num_groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(num_heads * head_dim, *rest)
    k = grouped[:, per_group].reshape(num_groups * head_dim, *rest)
    v = grouped[:, per_group + 1].reshape(num_groups * head_dim, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def merge_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int, head_dim: int
) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    per_group = num_heads // num_groups
    rest = tuple(q.shape[1:])
    for name, t, rows in (
        ("q", q, num_heads * head_dim),
        ("k", k, num_groups * head_dim),
        ("v", v, num_groups * head_dim),
    ):
        if tuple(t.shape) != (rows, *rest):
            raise ConversionError(
                f"{name} projection has shape {tuple(t.shape)}, expected {(rows, *rest)} "
                f"({num_heads} heads, {num_groups} key/value heads, head dim {head_dim})"
            )
    grouped = torch.cat(
        [
            q.reshape(num_groups, per_group, head_dim, *rest),
            k.reshape(num_groups, 1, head_dim, *rest),
            v.reshape(num_groups, 1, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape((num_heads + 2 * num_groups) * head_dim, *rest).contiguous()


class Architecture:
    """One megalm <-> Hugging Face mapping.  Subclasses fill in every method."""

    name: str = ""
    hf_class: str = ""  # e.g. "LlamaForCausalLM"
    hf_model_types: Tuple[str, ...] = ()
    moe: bool = False  # maps mixture-of-experts models (megalm --num-experts)
    # megalm_fields() entries that an explicit flag may override on import (training-only settings).
    overridable_fields: Tuple[str, ...] = ()

    def megalm_mismatches(self, m) -> List[str]:
        """Why the megalm model config ``m`` cannot be written as this architecture (empty: it can)."""
        raise NotImplementedError

    def hf_config(self, m, dtype_name: str, special_ids: dict) -> dict:
        """``config.json`` content for the megalm model config ``m``."""
        raise NotImplementedError

    def megalm_fields(self, hf: dict) -> dict:
        """megalm ``ModelConfig`` fields from an HF config; :class:`ConversionError` names any unmappable field."""
        raise NotImplementedError

    def to_hf(self, m, load: LoadFn) -> NamedTensors:
        """``(hf name, tensor)`` pairs; ``load(names)`` returns full megalm tensors (loaded a layer at a time)."""
        raise NotImplementedError

    def to_megalm(self, m, hf_get: Callable[[str], torch.Tensor], hf_keys: List[str]) -> NamedTensors:
        """``(megalm name, tensor)`` pairs from the HF tensors; every HF key must be used or known to be ignorable."""
        raise NotImplementedError

    def export_notes(self, m) -> List[str]:
        """Lines for the user about settings of ``m`` that the HF model keeps only approximately (training-only)."""
        return []

    def import_notes(self, hf: dict) -> List[str]:
        """Lines for the user about ``config.json`` settings that megalm keeps only approximately."""
        return []


def check_all_used(directory: str, keys: Iterable[str], used: Iterable[str], ignorable=lambda k: False) -> None:
    """Refuse HF weights the mapping did not consume (they would be silently dropped)."""
    left = sorted(k for k in set(keys) - set(used) if not ignorable(k))
    if left:
        raise ConversionError(
            f"{directory}: {len(left)} tensors have no megalm counterpart, e.g. {left[:5]}; "
            f"the model has parts this mapping does not know"
        )


def get_field(hf: dict, name: str, default=None):
    value = hf.get(name, default)
    return default if value is None else value


def checkpoint_shapes(m) -> Dict[str, tuple]:
    """Full shapes of every model tensor of megalm model config ``m`` as a checkpoint stores them."""
    h, n, d, f = m.hidden_size, m.num_attention_heads, m.head_dim, m.ffn_hidden_size
    groups = m.num_query_groups if m.group_query_attention else n
    shapes = {WORD_EMBEDDINGS: (m.vocab_size, h)}
    if m.position_embedding_type == "learned_absolute":
        shapes[POSITION_EMBEDDINGS] = (m.max_position_embeddings, h)
    norm_parts = ("weight", "bias") if m.normalization == "LayerNorm" else ("weight",)
    attention = {"self_attention.linear_qkv": ((n + 2 * groups) * d, h), "self_attention.linear_proj": (h, n * d)}
    mla_norms = {}
    if m.multi_latent_attention:
        attention, mla_norms = mla_attention_shapes(m), mla_norm_shapes(m)
    dense = {"mlp.linear_fc1": (2, f, h) if m.gated_linear_unit else (f, h), "mlp.linear_fc2": (h, f)}
    moe = {}
    if m.num_experts:
        big_f = m.moe_ffn_hidden_size or f
        for j in range(m.num_experts):
            moe[expert(j, "linear_fc1")] = (2 * big_f if m.gated_linear_unit else big_f, h)
            moe[expert(j, "linear_fc2")] = (h, big_f)
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            moe["mlp.shared_experts.linear_fc1"] = (2, shared, h) if m.gated_linear_unit else (shared, h)
            moe["mlp.shared_experts.linear_fc2"] = (h, shared)
    for i, is_moe in enumerate(moe_layers(m)):
        for norm in ("input_layernorm", "pre_mlp_layernorm"):
            for part in norm_parts:
                shapes[layer(i, f"{norm}.{part}")] = (h,)
        if is_moe:
            shapes[layer(i, ROUTER)] = (m.num_experts, h)
            if m.add_bias_linear:
                shapes[layer(i, "mlp.router.bias")] = (m.num_experts,)
            if m.moe_shared_expert_intermediate_size and m.moe_shared_expert_gate:
                shapes[layer(i, "mlp.shared_experts.gate_weight")] = (1, h)
        for name, shape in {**attention, **(moe if is_moe else dense)}.items():
            shapes[layer(i, name + ".weight")] = shape
            if m.add_bias_linear or (m.add_qkv_bias and name == "self_attention.linear_qkv"):
                shapes[layer(i, name + ".bias")] = shape[:-1]
        if m.softmax_type == "learnable":
            shapes[layer(i, "self_attention.core_attention.softmax_offset")] = (n,)
        for name, shape in mla_norms.items():
            for part in norm_parts:
                shapes[layer(i, f"{name}.{part}")] = shape
        if m.qk_layernorm and not m.multi_latent_attention:
            for norm in ("q_layernorm", "k_layernorm"):
                for part in norm_parts:
                    shapes[layer(i, f"self_attention.{norm}.{part}")] = (d,)
    for part in norm_parts:
        shapes[f"{FINAL_NORM}.{part}"] = (h,)
    if m.untie_embeddings_and_output_weights:
        shapes[OUTPUT_LAYER] = (m.vocab_size, h)
    return shapes


def router_buffer_shapes(m) -> Dict[str, tuple]:
    """The routers' ``expert_bias`` buffers (``--moe-router-enable-expert-bias``), which checkpoints hold
    beside the parameters (megatron-core saves them under the same names)."""
    if not m.moe_router_enable_expert_bias:
        return {}
    return {layer(i, "mlp.router.expert_bias"): (m.num_experts,) for i, is_moe in enumerate(moe_layers(m)) if is_moe}
