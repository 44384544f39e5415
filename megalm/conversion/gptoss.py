"""gpt-oss megalm models <-> ``GptOssForCausalLM`` (transformers' ``gpt_oss``).

A gpt-oss model is a Mixtral-like MoE with biases on every linear layer (attention, router, experts),
learnable softmax sinks, sliding-window attention on some layers, YaRN rotary positions and the clamped
quick-GEGLU experts ``(clamp(up, -c, c) + 1) * g sigmoid(1.702 g)`` for ``g = min(gate, c)``.

Configuration (HF -> megalm flags)::

    sliding_window W, layer_types      --window-size W-1,0 --window-attn-skip-freq [1 sliding / 0 full per layer]
    sinks (always)                     --softmax-type learnable
    swiglu_limit c (alpha 1.702)       --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value c
    rope_parameters yarn               --rope-type yarn --rotary-scaling-factor factor
                                       --original-max-position-embeddings, --beta-fast/slow,
                                       --[no-]yarn-correction-range-round-to-int (= truncate), rope_theta
    attention_bias true                (megalm's default biases; the router and experts have them too)

Tensors of layer ``i`` (HF prefix ``model.layers.{i}.``; norms, q/k/v/o as :class:`~.llama.Llama`)::

    self_attention.core_attention.softmax_offset [n]      <-> self_attn.sinks
    mlp.router.weight [E, h], mlp.router.bias [E]         <-> mlp.router.weight, mlp.router.bias
    experts.local_experts.{j}.linear_fc1.weight [2F, h]   <-> mlp.experts.gate_up_proj[j] [h, 2F]
        (megalm [gate; up] rows; HF interleaves the columns: gate = [:, 0::2], up = [:, 1::2])
    experts.local_experts.{j}.linear_fc1.bias [2F]        <-> mlp.experts.gate_up_proj_bias[j] (interleaved)
    experts.local_experts.{j}.linear_fc2.weight [h, F]    <-> mlp.experts.down_proj[j] [F, h] (transposed)
    experts.local_experts.{j}.linear_fc2.bias [h]         <-> mlp.experts.down_proj_bias[j]

Routing: HF takes the top-k router logits and a softmax over them: megalm's default router.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from megalm.conversion.base import NamedTensors, expert, get_field, layer
from megalm.conversion.errors import ConversionError
from megalm.conversion.mixtral import Mixtral

SINKS = "self_attention.core_attention.softmax_offset"


def _layer_types(m) -> List[str]:
    from megalm.config.gptoss import layer_window

    return ["sliding_attention" if layer_window(m, i) is not None else "full_attention" for i in range(m.num_layers)]


class GptOss(Mixtral):
    name = "gpt_oss"
    hf_class = "GptOssForCausalLM"
    hf_model_types = ("gpt_oss",)
    moe = True

    def megalm_mismatches(self, m) -> List[str]:
        wrong = []
        if m.softmax_type != "learnable":
            return [f"--softmax-type {m.softmax_type} (gpt-oss has learnable sinks)"]
        if not m.add_bias_linear:
            wrong.append("--disable-bias-linear (gpt-oss has biases on attention, router and experts)")
        if not m.quick_geglu or m.glu_linear_offset != 1.0 or m.activation_func_clamp_value is None:
            wrong.append("its MLP (needs --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value c)")
        if m.position_embedding_type != "rope" or m.multi_latent_attention:
            wrong.append(f"--position-embedding-type {m.position_embedding_type} (needs rope, YaRN or not)")
        if m.normalization != "RMSNorm" or m.apply_layernorm_1p or m.qk_layernorm:
            wrong.append("its norms (needs RMSNorm, no --apply-layernorm-1p / --qk-layernorm)")
        windows = {m.window_size[0]} if m.window_size and m.window_size[0] >= 0 else set()
        if len(windows) > 1:
            wrong.append("several window sizes")
        if not m.untie_embeddings_and_output_weights:
            wrong.append("tied embeddings (gpt-oss unties them: --untie-embeddings-and-output-weights)")
        if m.moe_router_score_function != "softmax" or m.moe_router_pre_softmax:
            wrong.append("its router (needs softmax over the top-k logits)")
        if m.moe_shared_expert_intermediate_size or m.moe_expert_capacity_factor is not None:
            wrong.append("shared experts / expert capacity (gpt-oss has neither)")
        if any(not moe for moe in self._pattern(m)):
            wrong.append("dense layers (gpt-oss has experts in every layer)")
        return wrong

    @staticmethod
    def _pattern(m):
        from megalm.conversion.base import moe_layers

        return moe_layers(m)

    def hf_config(self, m, dtype_name: str, special_ids: dict) -> dict:
        groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
        if m.rope_type == "yarn":
            rope = {
                "rope_type": "yarn",
                "rope_theta": float(m.rotary_base),
                "factor": float(m.rotary_scaling_factor),
                "original_max_position_embeddings": int(m.original_max_position_embeddings or 4096),
                "beta_fast": float(m.beta_fast),
                "beta_slow": float(m.beta_slow),
                "truncate": bool(m.yarn_correction_range_round_to_int),
            }
            if m.mscale != 1.0 or m.mscale_all_dim != 0.0:
                rope.update(mscale=float(m.mscale), mscale_all_dim=float(m.mscale_all_dim))
        else:
            rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        window = m.window_size[0] + 1 if m.window_size and m.window_size[0] >= 0 else None
        return {
            "architectures": [self.hf_class],
            "model_type": "gpt_oss",
            "vocab_size": m.vocab_size,
            "hidden_size": m.hidden_size,
            "intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
            "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": groups,
            "head_dim": m.head_dim,
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.moe_router_topk,
            "sliding_window": window,
            "layer_types": _layer_types(m),
            "max_position_embeddings": m.max_position_embeddings,
            "rms_norm_eps": m.norm_epsilon,
            "rope_parameters": rope,
            "swiglu_limit": float(m.activation_func_clamp_value),
            "swiglu_alpha": 1.702,
            "attention_bias": True,
            "attention_dropout": m.attention_dropout,
            "router_aux_loss_coef": float(m.moe_aux_loss_coeff),
            "output_router_logits": False,
            "initializer_range": m.init_method_std,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "use_cache": True,
            "dtype": dtype_name,
            "bos_token_id": None,
            "eos_token_id": None,
            "pad_token_id": None,
            **special_ids,
        }

    def megalm_fields(self, hf: dict) -> dict:
        if float(get_field(hf, "swiglu_alpha", 1.702)) != 1.702:
            raise ConversionError(f"config.json swiglu_alpha = {hf['swiglu_alpha']}: megalm's quick-GELU uses 1.702")
        if not bool(get_field(hf, "attention_bias", True)):
            raise ConversionError("config.json attention_bias = false: megalm's gpt-oss has biases on all linears")
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        kv_heads = int(get_field(hf, "num_key_value_heads", heads))
        head_dim = int(get_field(hf, "head_dim", hidden // heads))
        layers = int(hf["num_hidden_layers"])
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]
        window = hf.get("sliding_window")
        sliding = [int(t == "sliding_attention") for t in types]
        rope = dict(hf.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 150000.0)))
        fields = {
            "num_layers": layers,
            "hidden_size": hidden,
            "ffn_hidden_size": int(hf["intermediate_size"]),
            "moe_ffn_hidden_size": int(hf["intermediate_size"]),
            "num_attention_heads": heads,
            "kv_channels": None if head_dim * heads == hidden else head_dim,
            "group_query_attention": kv_heads != heads,
            "num_query_groups": kv_heads if kv_heads != heads else None,
            "max_position_embeddings": int(hf["max_position_embeddings"]),
            "rotary_base": theta,
            "rotary_percent": 1.0,
            "normalization": "RMSNorm",
            "norm_epsilon": float(get_field(hf, "rms_norm_eps", 1e-5)),
            "swiglu": False,
            "quick_geglu": True,
            "glu_linear_offset": 1.0,
            "activation_func_clamp_value": float(get_field(hf, "swiglu_limit", 7.0)),
            "softmax_type": "learnable",
            "window_size": [int(window) - 1, 0] if window and any(sliding) else None,
            "window_attn_skip_freq": sliding if window and any(sliding) and not all(sliding) else None,
            "add_bias_linear": True,
            "untie_embeddings_and_output_weights": not bool(get_field(hf, "tie_word_embeddings", False)),
            "hidden_dropout": 0.0,
            "attention_dropout": float(get_field(hf, "attention_dropout", 0.0)),
            "init_method_std": float(get_field(hf, "initializer_range", 0.02)),
            "vocab_size": int(hf["vocab_size"]),
            "num_experts": int(hf["num_local_experts"]),
            "moe_router_topk": int(get_field(hf, "num_experts_per_tok", 4)),
            "moe_layer_freq": 1,
            "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": False,
            "moe_shared_expert_intermediate_size": None,
            "moe_expert_capacity_factor": None,
            "moe_pad_expert_input_to_capacity": False,
            "moe_aux_loss_coeff": float(get_field(hf, "router_aux_loss_coef", 0.001)),
        }
        if rope.get("rope_type", "default") == "yarn":
            fields.update(
                position_embedding_type="rope",
                rope_type="yarn",
                rotary_scaling_factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32.0),
                beta_slow=float(rope.get("beta_slow") or 1.0),
                yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
                mscale=float(rope.get("mscale") or 1.0) if rope.get("mscale_all_dim") else 1.0,
                mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            )
            if rope.get("attention_factor") is not None:
                raise ConversionError("config.json rope_parameters.attention_factor: megalm derives it from mscale")
        elif rope.get("rope_type", "default") == "default":
            fields.update(position_embedding_type="rope", rope_type="rope")
        else:
            raise ConversionError(f"config.json rope_type {rope.get('rope_type')!r}: megalm has rope and yarn")
        return fields

    # --- one layer ---------------------------------------------------------------------------------

    def attention_names(self, m, i: int) -> List[str]:
        return super().attention_names(m, i) + [layer(i, SINKS)]

    def attention_to_hf(self, m, i: int, t: Dict[str, torch.Tensor]) -> NamedTensors:
        yield from super().attention_to_hf(m, i, t)
        yield f"model.layers.{i}.self_attn.sinks", t[layer(i, SINKS)]

    def attention_to_megalm(self, m, i: int, get: Callable[[str], torch.Tensor]) -> NamedTensors:
        yield from super().attention_to_megalm(m, i, get)
        yield layer(i, SINKS), get(f"model.layers.{i}.self_attn.sinks")

    def mlp_names(self, m, i: int) -> List[str]:
        names = [layer(i, "mlp.router.weight"), layer(i, "mlp.router.bias")]
        return names + [
            layer(i, expert(j, f"linear_fc{n}.{kind}"))
            for j in range(m.num_experts)
            for n in (1, 2)
            for kind in ("weight", "bias")
        ]

    def mlp_to_hf(self, m, i: int, t: Dict[str, torch.Tensor]) -> NamedTensors:
        hf = f"model.layers.{i}.mlp."
        yield hf + "router.weight", t[layer(i, "mlp.router.weight")]
        yield hf + "router.bias", t[layer(i, "mlp.router.bias")]
        gate_up, gate_up_bias, down, down_bias = [], [], [], []
        for j in range(m.num_experts):
            w, b = t[layer(i, expert(j, "linear_fc1.weight"))], t[layer(i, expert(j, "linear_fc1.bias"))]
            f = w.shape[0] // 2
            gate_up.append(torch.stack([w[:f], w[f:]], dim=1).reshape(2 * f, -1).t())  # interleave rows -> columns
            gate_up_bias.append(torch.stack([b[:f], b[f:]], dim=1).reshape(2 * f))
            down.append(t[layer(i, expert(j, "linear_fc2.weight"))].t())
            down_bias.append(t[layer(i, expert(j, "linear_fc2.bias"))])
        yield hf + "experts.gate_up_proj", torch.stack(gate_up).contiguous()
        yield hf + "experts.gate_up_proj_bias", torch.stack(gate_up_bias).contiguous()
        yield hf + "experts.down_proj", torch.stack(down).contiguous()
        yield hf + "experts.down_proj_bias", torch.stack(down_bias).contiguous()

    def mlp_to_megalm(self, m, i: int, get: Callable[[str], torch.Tensor], hf_keys: List[str]) -> NamedTensors:
        hf = f"model.layers.{i}.mlp."
        yield layer(i, "mlp.router.weight"), get(hf + "router.weight")
        yield layer(i, "mlp.router.bias"), get(hf + "router.bias")
        gate_up, gate_up_bias = get(hf + "experts.gate_up_proj"), get(hf + "experts.gate_up_proj_bias")
        down, down_bias = get(hf + "experts.down_proj"), get(hf + "experts.down_proj_bias")
        if gate_up.shape[0] != m.num_experts:
            raise ConversionError(f"{hf}experts.gate_up_proj holds {gate_up.shape[0]} experts, not {m.num_experts}")
        for j in range(m.num_experts):
            w, b = gate_up[j], gate_up_bias[j]
            yield layer(i, expert(j, "linear_fc1.weight")), torch.cat([w[:, 0::2].t(), w[:, 1::2].t()]).contiguous()
            yield layer(i, expert(j, "linear_fc1.bias")), torch.cat([b[0::2], b[1::2]]).contiguous()
            yield layer(i, expert(j, "linear_fc2.weight")), down[j].t().contiguous()
            yield layer(i, expert(j, "linear_fc2.bias")), down_bias[j].contiguous()

    def export_notes(self, m) -> List[str]:
        return [
            f"gpt-oss: {m.num_experts} experts top-{m.moe_router_topk} (softmax over the top-k logits, as megalm), "
            f"sinks, window {m.window_size}, clamp {m.activation_func_clamp_value}"
        ]

    def import_notes(self, hf: dict) -> List[str]:
        return [f"gpt-oss: sliding_window {hf.get('sliding_window')} -> --window-size W-1,0 (Megatron's left size)"]
