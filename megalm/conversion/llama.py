"""Llama-style megalm models <-> ``LlamaForCausalLM``.

megalm side: rotary positions over the whole head (``--rotary-percent 1``), RMSNorm, SwiGLU,
MHA or GQA, biases on all linear layers or none, tied or untied output layer.

Tensor mapping (per layer ``i``; HF prefix ``model.layers.{i}.``)::

    input_layernorm.weight                <-> input_layernorm.weight
    self_attention.linear_qkv.{w,b}       <-> self_attn.{q,k,v}_proj.{w,b}  (split per query group)
    self_attention.linear_proj.{w,b}      <-> self_attn.o_proj.{w,b}
    pre_mlp_layernorm.weight              <-> post_attention_layernorm.weight
    mlp.linear_fc1.{w,b} [2, f, ...]      <-> mlp.gate_proj (index 0), mlp.up_proj (index 1)
    mlp.linear_fc2.{w,b}                  <-> mlp.down_proj.{w,b}

RoPE: megalm and HF Llama both use the non-interleaved "rotate half" form with
``inv_freq = base^(-2i/d)`` and ``cos/sin`` of ``[freqs, freqs]``, so q/k rows need no
permutation (the permutation in HF's conversion script is for Meta's interleaved originals);
the tests check the logits.  Attention biases and MLP biases must agree (megalm has one
``--disable-bias-linear`` switch).

Each layer is mapped by two pairs of hooks, attention (with both norms) and MLP;
:class:`~megalm.conversion.mixtral.Mixtral` subclasses this mapping and replaces only the MLP hooks.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from megalm.conversion.base import (
    FINAL_NORM,
    OUTPUT_LAYER,
    WORD_EMBEDDINGS,
    Architecture,
    NamedTensors,
    check_all_used,
    get_field,
    layer,
    merge_qkv,
    split_qkv,
)
from megalm.conversion.errors import ConversionError


def _rope_theta(hf: dict) -> float:
    """The rotary base, refusing any scaled RoPE (v4 ``rope_scaling``, v5 ``rope_parameters``)."""
    scaling = hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind not in (None, "default"):
            raise ConversionError(
                f"config.json rope_scaling = {scaling!r}: megalm implements plain RoPE only (no {kind} scaling)"
            )
    params = hf.get("rope_parameters") or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ConversionError(f"config.json rope_parameters.rope_type = {kind!r}: megalm implements plain RoPE only")
    for source in (params, hf):
        factor = source.get("partial_rotary_factor")
        if factor not in (None, 1, 1.0):
            raise ConversionError(
                f"config.json partial_rotary_factor = {factor}: LlamaForCausalLM mapping needs RoPE over the whole head"
            )
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


class Llama(Architecture):
    name = "llama"
    hf_class = "LlamaForCausalLM"
    hf_model_types = ("llama",)

    def megalm_mismatches(self, m) -> List[str]:
        wrong = []
        if m.num_experts and not self.moe:
            wrong.append(f"--num-experts {m.num_experts} ({self.hf_class} is dense)")
        if m.multi_latent_attention and not getattr(self, "mla", False):
            wrong.append(f"--multi-latent-attention ({self.hf_class} has grouped-query attention)")
        if m.rope_type == "yarn" and m.rotary_scaling_factor != 1.0 and not getattr(self, "mla", False):
            wrong.append(f"--rope-type yarn --rotary-scaling-factor {m.rotary_scaling_factor} (plain RoPE only)")
        if m.position_embedding_type != "rope":
            wrong.append(f"--position-embedding-type {m.position_embedding_type} (needs rope)")
        elif m.rotary_percent != 1.0:
            wrong.append(f"--rotary-percent {m.rotary_percent} (needs 1.0)")
        if m.normalization != "RMSNorm":
            wrong.append(f"--normalization {m.normalization} (needs RMSNorm)")
        if m.apply_layernorm_1p:
            wrong.append("--apply-layernorm-1p (Hugging Face's norms scale by weight, not 1 + weight)")
        if m.qk_layernorm:
            wrong.append("--qk-layernorm (Llama has no query/key norms)")
        if m.add_qkv_bias and not m.add_bias_linear:
            wrong.append("--add-qkv-bias (Llama has no bias on the QKV projection alone)")
        if not m.swiglu:
            wrong.append(f"{'--squared-relu' if m.squared_relu else 'GELU'} MLP (needs --swiglu)")
        if m.glu_linear_offset or m.activation_func_clamp_value is not None:
            wrong.append("--glu-linear-offset / --activation-func-clamp-value (plain SwiGLU only)")
        if m.softmax_type != "vanilla" or (m.window_size and m.window_size[0] >= 0):
            wrong.append("softmax sinks / sliding windows (full causal attention only)")
        return wrong

    def hf_config(self, m, dtype_name: str, special_ids: dict) -> dict:
        groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
        return {
            "architectures": [self.hf_class],
            "model_type": "llama",
            "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size,
            "intermediate_size": m.ffn_hidden_size,
            "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": groups,
            "head_dim": m.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": m.max_position_embeddings,
            "rms_norm_eps": m.norm_epsilon,
            "rope_theta": float(m.rotary_base),
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
            "attention_bias": bool(m.add_bias_linear),
            "mlp_bias": bool(m.add_bias_linear),
            "attention_dropout": m.attention_dropout,
            "initializer_range": m.init_method_std,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
            "pretraining_tp": 1,
            "use_cache": True,
            "dtype": dtype_name,
            "torch_dtype": dtype_name,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
            **special_ids,
        }

    def megalm_fields(self, hf: dict) -> dict:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConversionError(f"config.json hidden_act = {act!r}: megalm's SwiGLU uses silu")
        attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ConversionError(
                f"config.json attention_bias = {attention_bias} but mlp_bias = {mlp_bias}: megalm "
                f"has biases on all linear layers or on none (--disable-bias-linear)"
            )
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        kv_heads = int(get_field(hf, "num_key_value_heads", heads))
        head_dim = int(get_field(hf, "head_dim", hidden // heads))
        if heads % kv_heads:
            raise ConversionError(
                f"config.json num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        return {
            "num_layers": int(hf["num_hidden_layers"]),
            "hidden_size": hidden,
            "ffn_hidden_size": int(hf["intermediate_size"]),
            "num_attention_heads": heads,
            "kv_channels": None if head_dim * heads == hidden else head_dim,
            "group_query_attention": kv_heads != heads,
            "num_query_groups": kv_heads if kv_heads != heads else None,
            "max_position_embeddings": int(hf["max_position_embeddings"]),
            "position_embedding_type": "rope",
            "rotary_base": _rope_theta(hf),
            "rotary_percent": 1.0,
            "normalization": "RMSNorm",
            "norm_epsilon": float(get_field(hf, "rms_norm_eps", 1e-6)),
            "swiglu": True,
            "add_bias_linear": attention_bias,
            "untie_embeddings_and_output_weights": not bool(get_field(hf, "tie_word_embeddings", False)),
            "hidden_dropout": 0.0,
            "attention_dropout": float(get_field(hf, "attention_dropout", 0.0)),
            "init_method_std": float(get_field(hf, "initializer_range", 0.02)),
            "vocab_size": int(hf["vocab_size"]),
            "num_experts": None,  # dense: --num-experts on import is refused as disagreeing
        }

    @staticmethod
    def _groups(m) -> int:
        return m.num_query_groups if m.group_query_attention else m.num_attention_heads

    @staticmethod
    def _kinds(m):
        return ("weight", "bias") if m.add_bias_linear else ("weight",)

    # --- one decoder layer; :class:`~megalm.conversion.mixtral.Mixtral` replaces only the MLP part ---

    def attention_names(self, m, i: int) -> List[str]:
        """megalm names of layer ``i``'s norms and attention."""
        names = [layer(i, "input_layernorm.weight"), layer(i, "pre_mlp_layernorm.weight")]
        return names + [
            layer(i, f"self_attention.{p}.{kind}") for p in ("linear_qkv", "linear_proj") for kind in self._kinds(m)
        ]

    def attention_to_hf(self, m, i: int, t: Dict[str, torch.Tensor]) -> NamedTensors:
        """HF norms and attention of layer ``i`` from the megalm tensors ``t`` (keyed by megalm name)."""
        hf = f"model.layers.{i}."
        yield hf + "input_layernorm.weight", t[layer(i, "input_layernorm.weight")]
        for kind in self._kinds(m):
            q, k, v = split_qkv(
                t[layer(i, f"self_attention.linear_qkv.{kind}")], m.num_attention_heads, self._groups(m), m.head_dim
            )
            yield hf + f"self_attn.q_proj.{kind}", q
            yield hf + f"self_attn.k_proj.{kind}", k
            yield hf + f"self_attn.v_proj.{kind}", v
            yield hf + f"self_attn.o_proj.{kind}", t[layer(i, f"self_attention.linear_proj.{kind}")]
        yield hf + "post_attention_layernorm.weight", t[layer(i, "pre_mlp_layernorm.weight")]

    def attention_to_megalm(self, m, i: int, get: Callable[[str], torch.Tensor]) -> NamedTensors:
        """Inverse of :meth:`attention_to_hf`; ``get`` reads (and marks as used) an HF tensor."""
        hf = f"model.layers.{i}."
        yield layer(i, "input_layernorm.weight"), get(hf + "input_layernorm.weight")
        for kind in self._kinds(m):
            q, k, v = (get(hf + f"self_attn.{p}_proj.{kind}") for p in "qkv")
            yield (
                layer(i, f"self_attention.linear_qkv.{kind}"),
                merge_qkv(q, k, v, m.num_attention_heads, self._groups(m), m.head_dim),
            )
            yield layer(i, f"self_attention.linear_proj.{kind}"), get(hf + f"self_attn.o_proj.{kind}")
        yield layer(i, "pre_mlp_layernorm.weight"), get(hf + "post_attention_layernorm.weight")

    def mlp_names(self, m, i: int) -> List[str]:
        return [layer(i, f"mlp.linear_fc{n}.{kind}") for n in (1, 2) for kind in self._kinds(m)]

    def mlp_to_hf(self, m, i: int, t: Dict[str, torch.Tensor]) -> NamedTensors:
        hf = f"model.layers.{i}."
        for kind in self._kinds(m):
            fc1 = t[layer(i, f"mlp.linear_fc1.{kind}")]
            if fc1.shape[0] != 2:
                raise ConversionError(
                    f"{layer(i, 'mlp.linear_fc1.' + kind)}: SwiGLU fc1 should be saved as "
                    f"[2, ffn, ...], got {tuple(fc1.shape)}"
                )
            yield hf + f"mlp.gate_proj.{kind}", fc1[0].contiguous()
            yield hf + f"mlp.up_proj.{kind}", fc1[1].contiguous()
            yield hf + f"mlp.down_proj.{kind}", t[layer(i, f"mlp.linear_fc2.{kind}")]

    def mlp_to_megalm(self, m, i: int, get: Callable[[str], torch.Tensor], hf_keys: List[str]) -> NamedTensors:
        hf = f"model.layers.{i}."
        for kind in self._kinds(m):
            gate, up = get(hf + f"mlp.gate_proj.{kind}"), get(hf + f"mlp.up_proj.{kind}")
            yield layer(i, f"mlp.linear_fc1.{kind}"), torch.stack([gate, up])
            yield layer(i, f"mlp.linear_fc2.{kind}"), get(hf + f"mlp.down_proj.{kind}")

    # --- the whole model ---------------------------------------------------------------------

    def to_hf(self, m, load) -> NamedTensors:
        first = load([WORD_EMBEDDINGS])
        yield "model.embed_tokens.weight", first[WORD_EMBEDDINGS]
        for i in range(m.num_layers):
            t = load(self.attention_names(m, i) + self.mlp_names(m, i))  # one layer at a time
            yield from self.attention_to_hf(m, i, t)
            yield from self.mlp_to_hf(m, i, t)
        last_names = [FINAL_NORM + ".weight"] + ([OUTPUT_LAYER] if m.untie_embeddings_and_output_weights else [])
        last = load(last_names)
        yield "model.norm.weight", last[FINAL_NORM + ".weight"]
        if m.untie_embeddings_and_output_weights:
            yield "lm_head.weight", last[OUTPUT_LAYER]

    def to_megalm(self, m, hf_get: Callable[[str], torch.Tensor], hf_keys: List[str]) -> NamedTensors:
        used = set()

        def get(name):
            used.add(name)
            return hf_get(name)

        tied = not m.untie_embeddings_and_output_weights
        embed = get("model.embed_tokens.weight")
        yield WORD_EMBEDDINGS, embed
        for i in range(m.num_layers):
            yield from self.attention_to_megalm(m, i, get)
            yield from self.mlp_to_megalm(m, i, get, hf_keys)
        yield FINAL_NORM + ".weight", get("model.norm.weight")
        has_head = "lm_head.weight" in hf_keys
        if tied and has_head:
            if not torch.equal(get("lm_head.weight"), embed):
                raise ConversionError(
                    "config.json tie_word_embeddings = true but lm_head.weight differs from model.embed_tokens.weight"
                )
        elif not tied:
            if not has_head:
                raise ConversionError("config.json tie_word_embeddings = false but the weights have no lm_head.weight")
            yield OUTPUT_LAYER, get("lm_head.weight")
        check_all_used(
            "the Hugging Face directory", hf_keys, used, ignorable=lambda k: k.endswith("rotary_emb.inv_freq")
        )
