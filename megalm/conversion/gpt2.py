"""GPT-2-style megalm models <-> ``GPT2LMHeadModel``.

megalm side: learned absolute positions, LayerNorm, GELU (exact, erf), biases, multi-head
attention with head dim = hidden / heads, tied (or untied) output layer.

GPT-2 stores its linear layers as ``Conv1D`` with weights ``[in, out]`` (the transpose of
``nn.Linear``), and ``c_attn`` concatenates ``[all q ; all k ; all v]`` along the output,
whereas megalm's fused QKV interleaves them per head (``[q_h ; k_h ; v_h]``)::

    transformer.wte.weight / wpe.weight   <-> embedding.word_embeddings / position_embeddings
    h.{i}.ln_1, ln_2                      <-> input_layernorm, pre_mlp_layernorm
    h.{i}.attn.c_attn [h, 3h]             <-> linear_qkv [3h, h] (transposed, regrouped per head)
    h.{i}.attn.c_proj [h, h]              <-> linear_proj (transposed)
    h.{i}.mlp.c_fc [h, f], c_proj [f, h]  <-> linear_fc1, linear_fc2 (transposed)
    transformer.ln_f                      <-> decoder.final_layernorm
    lm_head.weight                        <-> output_layer.weight (untied only)

``activation_function``: ``"gelu"`` (exact) <-> megalm's default GELU; ``"gelu_new"`` (the tanh
approximation of the original GPT-2 weights) <-> ``--openai-gelu``; ``"relu2"`` (transformers'
``ReLUSquaredActivation``, ``relu(x)^2``) <-> ``--squared-relu``.
"""

from __future__ import annotations

from typing import Callable, List

import torch

from megalm.conversion.base import (
    FINAL_NORM,
    OUTPUT_LAYER,
    POSITION_EMBEDDINGS,
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

_LAYER_PARTS = {  # megalm suffix -> (GPT-2 suffix, transposed)
    "input_layernorm": ("ln_1", False),
    "self_attention.linear_proj": ("attn.c_proj", True),
    "pre_mlp_layernorm": ("ln_2", False),
    "mlp.linear_fc1": ("mlp.c_fc", True),
    "mlp.linear_fc2": ("mlp.c_proj", True),
}


class GPT2(Architecture):
    name = "gpt2"
    hf_class = "GPT2LMHeadModel"
    hf_model_types = ("gpt2",)

    def megalm_mismatches(self, m) -> List[str]:
        wrong = []
        if m.position_embedding_type != "learned_absolute":
            wrong.append(f"--position-embedding-type {m.position_embedding_type} (needs learned_absolute)")
        if m.normalization != "LayerNorm":
            wrong.append(f"--normalization {m.normalization} (needs LayerNorm)")
        if m.apply_layernorm_1p:
            wrong.append("--apply-layernorm-1p (Hugging Face's norms scale by weight, not 1 + weight)")
        if m.qk_layernorm:
            wrong.append("--qk-layernorm (GPT-2 has no query/key norms)")
        if m.add_qkv_bias and not m.add_bias_linear:
            wrong.append("--add-qkv-bias (GPT-2 has no bias on the QKV projection alone)")
        if m.swiglu:
            wrong.append("--swiglu (needs GELU or squared ReLU)")
        if not m.add_bias_linear:
            wrong.append("--disable-bias-linear (needs biases)")
        if m.group_query_attention:
            wrong.append("--group-query-attention (GPT-2 has multi-head attention only)")
        if m.head_dim * m.num_attention_heads != m.hidden_size:
            wrong.append(f"--kv-channels {m.kv_channels} (GPT-2's head dim is hidden / heads)")
        if m.softmax_type != "vanilla" or (m.window_size and m.window_size[0] >= 0) or m.quick_geglu:
            wrong.append("gpt-oss attention / MLP variants")
        return wrong

    def hf_config(self, m, dtype_name: str, special_ids: dict) -> dict:
        return {
            "architectures": [self.hf_class],
            "model_type": "gpt2",
            "vocab_size": m.vocab_size,
            "n_embd": m.hidden_size,
            "n_layer": m.num_layers,
            "n_head": m.num_attention_heads,
            "n_inner": m.ffn_hidden_size,
            "n_positions": m.max_position_embeddings,
            "activation_function": "relu2" if m.squared_relu else "gelu_new" if m.openai_gelu else "gelu",
            "layer_norm_epsilon": m.norm_epsilon,
            "resid_pdrop": m.hidden_dropout,
            "embd_pdrop": m.hidden_dropout,
            "attn_pdrop": m.attention_dropout,
            "initializer_range": m.init_method_std,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
            "use_cache": True,
            "dtype": dtype_name,
            "torch_dtype": dtype_name,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
            **special_ids,
        }

    def megalm_fields(self, hf: dict) -> dict:
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu", "gelu_new", "relu2"):
            raise ConversionError(
                f"config.json activation_function = {act!r}: megalm has the exact (erf) GELU ('gelu'), its "
                f"tanh approximation ('gelu_new', --openai-gelu) and squared ReLU ('relu2', --squared-relu) only"
            )
        if not hf.get("scale_attn_weights", True):
            raise ConversionError("config.json scale_attn_weights = false: megalm always scales attention by 1/sqrt(d)")
        if hf.get("scale_attn_by_inverse_layer_idx", False):
            raise ConversionError("config.json scale_attn_by_inverse_layer_idx = true is not supported by megalm")
        if hf.get("add_cross_attention", False):
            raise ConversionError("config.json add_cross_attention = true: megalm is decoder-only")
        hidden = int(hf["n_embd"])
        heads = int(hf["n_head"])
        if hidden % heads:
            raise ConversionError(f"config.json n_embd {hidden} is not divisible by n_head {heads}")
        return {
            "num_layers": int(hf["n_layer"]),
            "hidden_size": hidden,
            "ffn_hidden_size": int(get_field(hf, "n_inner", 4 * hidden)),
            "num_attention_heads": heads,
            "kv_channels": None,
            "group_query_attention": False,
            "num_query_groups": None,
            "max_position_embeddings": int(get_field(hf, "n_positions", get_field(hf, "n_ctx", 1024))),
            "position_embedding_type": "learned_absolute",
            "openai_gelu": act == "gelu_new",
            "squared_relu": act == "relu2",
            "normalization": "LayerNorm",
            "norm_epsilon": float(get_field(hf, "layer_norm_epsilon", 1e-5)),
            "swiglu": False,
            "add_bias_linear": True,
            "untie_embeddings_and_output_weights": not bool(get_field(hf, "tie_word_embeddings", True)),
            "hidden_dropout": float(get_field(hf, "resid_pdrop", 0.1)),
            "attention_dropout": float(get_field(hf, "attn_pdrop", 0.1)),
            "init_method_std": float(get_field(hf, "initializer_range", 0.02)),
            "vocab_size": int(hf["vocab_size"]),
            "num_experts": None,  # dense: --num-experts on import is refused as disagreeing
        }

    def to_hf(self, m, load) -> NamedTensors:
        n, d = m.num_attention_heads, m.head_dim
        first = load([WORD_EMBEDDINGS, POSITION_EMBEDDINGS])
        yield "transformer.wte.weight", first[WORD_EMBEDDINGS]
        yield "transformer.wpe.weight", first[POSITION_EMBEDDINGS]
        for i in range(m.num_layers):
            names = [
                layer(i, f"{part}.{kind}")
                for part in list(_LAYER_PARTS) + ["self_attention.linear_qkv"]
                for kind in ("weight", "bias")
            ]
            t = load(names)
            hf = f"transformer.h.{i}."
            for part, (gpt2_part, transposed) in _LAYER_PARTS.items():
                weight = t[layer(i, f"{part}.weight")]
                yield hf + f"{gpt2_part}.weight", weight.t().contiguous() if transposed else weight
                yield hf + f"{gpt2_part}.bias", t[layer(i, f"{part}.bias")]
            qw, kw, vw = split_qkv(t[layer(i, "self_attention.linear_qkv.weight")], n, n, d)
            qb, kb, vb = split_qkv(t[layer(i, "self_attention.linear_qkv.bias")], n, n, d)
            yield hf + "attn.c_attn.weight", torch.cat([qw, kw, vw]).t().contiguous()
            yield hf + "attn.c_attn.bias", torch.cat([qb, kb, vb])
        names = [FINAL_NORM + ".weight", FINAL_NORM + ".bias"]
        if m.untie_embeddings_and_output_weights:
            names.append(OUTPUT_LAYER)
        last = load(names)
        yield "transformer.ln_f.weight", last[FINAL_NORM + ".weight"]
        yield "transformer.ln_f.bias", last[FINAL_NORM + ".bias"]
        if m.untie_embeddings_and_output_weights:
            yield "lm_head.weight", last[OUTPUT_LAYER]

    def to_megalm(self, m, hf_get: Callable[[str], torch.Tensor], hf_keys: List[str]) -> NamedTensors:
        # The original GPT-2 files have no "transformer." prefix; save_pretrained writes it.
        prefix = "transformer." if "transformer.wte.weight" in hf_keys else ""
        used = set()

        def get(name):
            used.add(prefix + name)
            return hf_get(prefix + name)

        n, d, h = m.num_attention_heads, m.head_dim, m.hidden_size
        embed = get("wte.weight")
        yield WORD_EMBEDDINGS, embed
        yield POSITION_EMBEDDINGS, get("wpe.weight")
        for i in range(m.num_layers):
            hf = f"h.{i}."
            for part, (gpt2_part, transposed) in _LAYER_PARTS.items():
                weight = get(hf + f"{gpt2_part}.weight")
                yield layer(i, f"{part}.weight"), weight.t().contiguous() if transposed else weight
                yield layer(i, f"{part}.bias"), get(hf + f"{gpt2_part}.bias")
            w = get(hf + "attn.c_attn.weight").t()
            b = get(hf + "attn.c_attn.bias")
            yield layer(i, "self_attention.linear_qkv.weight"), merge_qkv(w[:h], w[h : 2 * h], w[2 * h :], n, n, d)
            yield layer(i, "self_attention.linear_qkv.bias"), merge_qkv(b[:h], b[h : 2 * h], b[2 * h :], n, n, d)
        yield FINAL_NORM + ".weight", get("ln_f.weight")
        yield FINAL_NORM + ".bias", get("ln_f.bias")
        tied = not m.untie_embeddings_and_output_weights
        if "lm_head.weight" in hf_keys:
            used.add("lm_head.weight")
            head = hf_get("lm_head.weight")
            if tied and not torch.equal(head, embed):
                raise ConversionError(
                    "config.json tie_word_embeddings = true but lm_head.weight differs from wte.weight"
                )
            if not tied:
                yield OUTPUT_LAYER, head
        elif not tied:
            raise ConversionError("config.json tie_word_embeddings = false but the weights have no lm_head.weight")
        # attn.bias / attn.masked_bias: the causal-mask buffers older files carry.
        check_all_used(
            "the Hugging Face directory",
            hf_keys,
            used,
            ignorable=lambda k: k.endswith((".attn.bias", ".attn.masked_bias")),
        )
