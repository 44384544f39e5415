"""DeepSeek-V3-style megalm models (multi-latent attention, dense first layers, sigmoid-routed
experts with a shared expert) <-> ``DeepseekV3ForCausalLM``.

Tensor mapping (per layer ``i``; HF prefix ``model.layers.{i}.``; megalm ``decoder.layers.{i}.``)::

    self_attention.linear_q_down_proj.weight  <-> self_attn.q_a_proj.weight      (with --q-lora-rank)
    self_attention.q_layernorm.weight         <-> self_attn.q_a_layernorm.weight
    self_attention.linear_q_up_proj.weight    <-> self_attn.q_b_proj.weight
    self_attention.linear_q_proj.weight       <-> self_attn.q_proj.weight        (without)
    self_attention.linear_kv_down_proj.weight <-> self_attn.kv_a_proj_with_mqa.weight
    self_attention.kv_layernorm.weight        <-> self_attn.kv_a_layernorm.weight
    self_attention.linear_kv_up_proj.weight   <-> self_attn.kv_b_proj.weight
    self_attention.linear_proj.weight         <-> self_attn.o_proj.weight
    dense layers (i < first_k_dense_replace): mlp as Llama's (gate_proj / up_proj / down_proj)
    MoE layers:
    mlp.router.weight                          <-> mlp.gate.weight
    mlp.router.expert_bias                     <-> mlp.gate.e_score_correction_bias
    mlp.experts.local_experts.{j}.linear_fc1   <-> mlp.experts.{j}.gate_proj (rows :F), up_proj (rows F:)
    mlp.experts.local_experts.{j}.linear_fc2   <-> mlp.experts.{j}.down_proj
    mlp.shared_experts.linear_fc1 [2, f, h]    <-> mlp.shared_experts.gate_proj (0), up_proj (1)
    mlp.shared_experts.linear_fc2              <-> mlp.shared_experts.down_proj

Both sides order each head's query/key as ``[no-RoPE ; RoPE]`` and the key/value up projection per
head as ``[key ; value]``; the RoPE channels are rotated in the interleaved-pair form on both sides
(megalm de-interleaves like Megatron's MLA; HF's ``rope_interleave = true``), so no row is permuted.
Export writes the original per-expert file layout (transformers 5.x fuses it on load); import also
reads 5.x's in-memory ``mlp.experts.gate_up_proj`` / ``down_proj``.

Routing.  HF: ``sigmoid`` scores, choice by scores + ``e_score_correction_bias`` among the
``topk_group`` best of ``n_group`` groups (a group's score: the sum of its 2 best), weights the chosen
scores renormalized (``norm_topk_prob``) times ``routed_scaling_factor`` = megalm's
``--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups
--moe-router-group-topk --moe-router-topk-scaling-factor`` (megalm's group score sums the
``topk / group_topk`` best: equal when that is 2, refused otherwise).

Refused: ``rope_interleave = false``, attention biases, ``norm_topk_prob = false`` with top-k > 1,
``rms_norm_eps`` other than 1e-6 (HF's latent norms use 1e-6 whatever it says), MTP weights
(``num_nextn_predict_layers``: the HF class does not run them; exported as 0).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from megalm.conversion.base import ROUTER, NamedTensors, expert, get_field, layer, moe_layers
from megalm.conversion.errors import ConversionError
from megalm.conversion.llama import Llama
from megalm.conversion.mla_shapes import ATTN, mla_attention_shapes, mla_norm_shapes

EXPERT_BIAS = "mlp.router.expert_bias"


_HF_ATTENTION = {
    "linear_q_proj": "q_proj",
    "linear_q_down_proj": "q_a_proj",
    "linear_q_up_proj": "q_b_proj",
    "linear_kv_down_proj": "kv_a_proj_with_mqa",
    "linear_kv_up_proj": "kv_b_proj",
    "linear_proj": "o_proj",
    "q_layernorm": "q_a_layernorm",
    "kv_layernorm": "kv_a_layernorm",
}


class DeepseekV3(Llama):
    name = "deepseek_v3"
    hf_class = "DeepseekV3ForCausalLM"
    hf_model_types = ("deepseek_v3",)
    moe = True
    mla = True
    overridable_fields = ("moe_aux_loss_coeff",)

    def megalm_mismatches(self, m) -> List[str]:
        wrong = [w for w in super().megalm_mismatches(m) if not w.startswith("--qk-layernorm")]
        if not m.multi_latent_attention:
            wrong.append("no --multi-latent-attention")
            return wrong
        if not m.qk_layernorm:
            wrong.append("no --qk-layernorm (DeepSeek-V3 normalizes the query and key/value latents)")
        if m.add_bias_linear:
            wrong.append("biases on linear layers (needs --disable-bias-linear)")
        if m.norm_epsilon != 1e-6:
            wrong.append(f"--norm-epsilon {m.norm_epsilon} (DeepSeek-V3's latent norms use 1e-6)")
        if m.moe_router_score_function != "sigmoid":
            wrong.append(f"--moe-router-score-function {m.moe_router_score_function} (DeepSeek-V3 uses sigmoid)")
        if not m.moe_router_enable_expert_bias:
            wrong.append("no --moe-router-enable-expert-bias (DeepSeek-V3's router has its correction bias)")
        if not m.moe_shared_expert_intermediate_size:
            wrong.append("no --moe-shared-expert-intermediate-size (DeepSeek-V3 has a shared expert)")
        elif m.moe_shared_expert_intermediate_size % (m.moe_ffn_hidden_size or m.ffn_hidden_size):
            wrong.append("--moe-shared-expert-intermediate-size not a multiple of --moe-ffn-hidden-size")
        if m.moe_shared_expert_gate:
            wrong.append("--moe-shared-expert-gate (DeepSeek-V3's shared expert has no gate)")
        if m.moe_router_group_topk and m.moe_router_topk // m.moe_router_group_topk != 2:
            wrong.append("--moe-router-topk / --moe-router-group-topk != 2 (HF's group score sums 2 experts)")
        pattern = moe_layers(m)
        k = pattern.index(True) if True in pattern else len(pattern)
        if pattern != [False] * k + [True] * (len(pattern) - k):
            wrong.append(f"--moe-layer-freq {m.moe_layer_freq}: DeepSeek-V3 has dense layers first, then MoE only")
        if m.moe_expert_capacity_factor is not None:
            wrong.append("--moe-expert-capacity-factor (drops tokens; DeepSeek-V3 is dropless)")
        return wrong

    def hf_config(self, m, dtype_name: str, special_ids: dict) -> dict:
        config = super().hf_config(m, dtype_name, special_ids)
        for key in ("head_dim", "mlp_bias", "rope_scaling"):
            config.pop(key, None)
        pattern = moe_layers(m)
        big_f = m.moe_ffn_hidden_size or m.ffn_hidden_size
        rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        if m.rope_type == "yarn" and m.rotary_scaling_factor != 1.0:
            rope = {
                "rope_type": "yarn",
                "rope_theta": float(m.rotary_base),
                "factor": float(m.rotary_scaling_factor),
                "original_max_position_embeddings": int(m.original_max_position_embeddings or 4096),
                "beta_fast": float(m.beta_fast),
                "beta_slow": float(m.beta_slow),
                "mscale": float(m.mscale),
                "mscale_all_dim": float(m.mscale_all_dim),
            }
        config.update(
            {
                "architectures": [self.hf_class],
                "model_type": "deepseek_v3",
                "num_key_value_heads": m.num_attention_heads,
                "q_lora_rank": m.q_lora_rank,
                "kv_lora_rank": m.kv_lora_rank,
                "qk_nope_head_dim": m.qk_head_dim,
                "qk_rope_head_dim": m.qk_pos_emb_head_dim,
                "v_head_dim": m.v_head_dim,
                "rope_interleave": True,
                "rope_parameters": rope,
                "rope_theta": float(m.rotary_base),
                "moe_intermediate_size": big_f,
                "n_routed_experts": m.num_experts,
                "n_shared_experts": m.moe_shared_expert_intermediate_size // big_f,
                "num_experts_per_tok": m.moe_router_topk,
                "n_group": m.moe_router_num_groups or 1,
                "topk_group": m.moe_router_group_topk or 1,
                "routed_scaling_factor": float(m.moe_router_topk_scaling_factor or 1.0),
                "norm_topk_prob": True,
                "first_k_dense_replace": pattern.index(True) if True in pattern else m.num_layers,
                "num_nextn_predict_layers": 0,
                "attention_bias": False,
            }
        )
        return config

    def megalm_fields(self, hf: dict) -> dict:
        if not get_field(hf, "rope_interleave", True):
            raise ConversionError("config.json rope_interleave = false: megalm's MLA rotates interleaved pairs")
        if get_field(hf, "attention_bias", False):
            raise ConversionError("config.json attention_bias = true: megalm's MLA has biases on all layers or none")
        eps = float(get_field(hf, "rms_norm_eps", 1e-6))
        if eps != 1e-6:
            raise ConversionError(
                f"config.json rms_norm_eps = {eps}: HF's DeepSeek-V3 latent norms use 1e-6, megalm one epsilon for all"
            )
        topk = int(get_field(hf, "num_experts_per_tok", 8))
        if not get_field(hf, "norm_topk_prob", True) and topk > 1:
            raise ConversionError("config.json norm_topk_prob = false: megalm renormalizes sigmoid top-k weights")
        groups, group_topk = int(get_field(hf, "n_group", 1)), int(get_field(hf, "topk_group", 1))
        if groups > 1 and topk // group_topk != 2:
            raise ConversionError(
                f"config.json num_experts_per_tok {topk} / topk_group {group_topk} != 2: HF scores a group by its "
                f"2 best experts, megalm (as Megatron) by its top-k / group-top-k best"
            )
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        hf_plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
        fields = super().megalm_fields({**hf_plain, "rope_theta": theta, "head_dim": None})
        layers, experts = int(hf["num_hidden_layers"]), int(get_field(hf, "n_routed_experts", 0))
        dense = min(int(get_field(hf, "first_k_dense_replace", 0)), layers)
        big_f = int(hf["moe_intermediate_size"])
        fields.update(
            {
                "kv_channels": None,
                "multi_latent_attention": True,
                "qk_layernorm": True,
                "q_lora_rank": hf.get("q_lora_rank"),
                "kv_lora_rank": int(hf["kv_lora_rank"]),
                "qk_head_dim": int(hf["qk_nope_head_dim"]),
                "qk_pos_emb_head_dim": int(hf["qk_rope_head_dim"]),
                "v_head_dim": int(hf["v_head_dim"]),
                "rope_type": "yarn" if kind == "yarn" else "rope",
                "rotary_scaling_factor": float(params.get("factor", 1.0)) if kind == "yarn" else 1.0,
                "original_max_position_embeddings": int(params.get("original_max_position_embeddings", 4096)),
                "beta_fast": float(params.get("beta_fast", 32.0)),
                "beta_slow": float(params.get("beta_slow", 1.0)),
                "mscale": float(params.get("mscale", 1.0)),
                "mscale_all_dim": float(params.get("mscale_all_dim", 0.0)),
                "num_experts": experts,
                "moe_layer_freq": [0] * dense + [1] * (layers - dense),
                "moe_ffn_hidden_size": big_f,
                "moe_shared_expert_intermediate_size": big_f * int(get_field(hf, "n_shared_experts", 1)),
                "moe_router_topk": topk,
                "moe_router_score_function": "sigmoid",
                "moe_router_pre_softmax": False,
                "moe_router_enable_expert_bias": True,
                "moe_router_num_groups": groups if groups > 1 else None,
                "moe_router_group_topk": group_topk if groups > 1 else None,
                "moe_router_topk_scaling_factor": float(get_field(hf, "routed_scaling_factor", 1.0)),
                "moe_router_dtype": "fp32",
                "moe_expert_capacity_factor": None,
                "moe_aux_loss_coeff": 0.0,
            }
        )
        return fields

    # --- attention -------------------------------------------------------------------------------

    def _attention_parts(self, m) -> List[str]:
        return [name[len(ATTN) :] for name in {**mla_attention_shapes(m), **mla_norm_shapes(m)}]

    def attention_names(self, m, i: int) -> List[str]:
        names = [layer(i, "input_layernorm.weight"), layer(i, "pre_mlp_layernorm.weight")]
        return names + [layer(i, f"{ATTN}{part}.weight") for part in self._attention_parts(m)]

    def attention_to_hf(self, m, i: int, t: Dict[str, torch.Tensor]) -> NamedTensors:
        hf = f"model.layers.{i}."
        yield hf + "input_layernorm.weight", t[layer(i, "input_layernorm.weight")]
        for part in self._attention_parts(m):
            yield hf + f"self_attn.{_HF_ATTENTION[part]}.weight", t[layer(i, f"{ATTN}{part}.weight")]
        yield hf + "post_attention_layernorm.weight", t[layer(i, "pre_mlp_layernorm.weight")]

    def attention_to_megalm(self, m, i: int, get: Callable[[str], torch.Tensor]) -> NamedTensors:
        hf = f"model.layers.{i}."
        yield layer(i, "input_layernorm.weight"), get(hf + "input_layernorm.weight")
        for part in self._attention_parts(m):
            yield layer(i, f"{ATTN}{part}.weight"), get(hf + f"self_attn.{_HF_ATTENTION[part]}.weight")
        yield layer(i, "pre_mlp_layernorm.weight"), get(hf + "post_attention_layernorm.weight")

    # --- MLP: dense (Llama's) or MoE ---------------------------------------------------------------

    def mlp_names(self, m, i: int) -> List[str]:
        if not moe_layers(m)[i]:
            return super().mlp_names(m, i)
        shared = [layer(i, f"mlp.shared_experts.linear_fc{n}.weight") for n in (1, 2)]
        experts = [layer(i, expert(j, f"linear_fc{n}.weight")) for j in range(m.num_experts) for n in (1, 2)]
        return [layer(i, ROUTER), layer(i, EXPERT_BIAS)] + shared + experts

    def mlp_to_hf(self, m, i: int, t: Dict[str, torch.Tensor]) -> NamedTensors:
        if not moe_layers(m)[i]:
            yield from super().mlp_to_hf(m, i, t)
            return
        hf = f"model.layers.{i}.mlp."
        yield hf + "gate.weight", t[layer(i, ROUTER)]
        yield hf + "gate.e_score_correction_bias", t[layer(i, EXPERT_BIAS)]
        fc1 = t[layer(i, "mlp.shared_experts.linear_fc1.weight")]
        yield hf + "shared_experts.gate_proj.weight", fc1[0].contiguous()
        yield hf + "shared_experts.up_proj.weight", fc1[1].contiguous()
        yield hf + "shared_experts.down_proj.weight", t[layer(i, "mlp.shared_experts.linear_fc2.weight")]
        for j in range(m.num_experts):
            fc1 = t[layer(i, expert(j, "linear_fc1.weight"))]
            f = fc1.shape[0] // 2
            yield hf + f"experts.{j}.gate_proj.weight", fc1[:f].contiguous()
            yield hf + f"experts.{j}.up_proj.weight", fc1[f:].contiguous()
            yield hf + f"experts.{j}.down_proj.weight", t[layer(i, expert(j, "linear_fc2.weight"))]

    def mlp_to_megalm(self, m, i: int, get: Callable[[str], torch.Tensor], hf_keys: List[str]) -> NamedTensors:
        if not moe_layers(m)[i]:
            yield from super().mlp_to_megalm(m, i, get, hf_keys)
            return
        hf = f"model.layers.{i}.mlp."
        yield layer(i, ROUTER), get(hf + "gate.weight")
        yield layer(i, EXPERT_BIAS), get(hf + "gate.e_score_correction_bias")
        gate, up = get(hf + "shared_experts.gate_proj.weight"), get(hf + "shared_experts.up_proj.weight")
        yield layer(i, "mlp.shared_experts.linear_fc1.weight"), torch.stack([gate, up])
        yield layer(i, "mlp.shared_experts.linear_fc2.weight"), get(hf + "shared_experts.down_proj.weight")
        if hf + "experts.gate_up_proj" in set(hf_keys):  # transformers 5.x fused layout
            gate_up, down = get(hf + "experts.gate_up_proj"), get(hf + "experts.down_proj")
            for j in range(m.num_experts):
                yield layer(i, expert(j, "linear_fc1.weight")), gate_up[j].contiguous()
                yield layer(i, expert(j, "linear_fc2.weight")), down[j].contiguous()
            return
        for j in range(m.num_experts):
            w = hf + f"experts.{j}."
            fc1 = torch.cat([get(w + "gate_proj.weight"), get(w + "up_proj.weight")])
            yield layer(i, expert(j, "linear_fc1.weight")), fc1
            yield layer(i, expert(j, "linear_fc2.weight")), get(w + "down_proj.weight")

    def import_notes(self, hf: dict) -> List[str]:
        notes = [
            f"router: {get_field(hf, 'n_routed_experts', 0)} experts, top-{get_field(hf, 'num_experts_per_tok', 8)}, "
            f"sigmoid with correction bias (--moe-router-enable-expert-bias); --moe-aux-loss-coeff 0"
        ]
        return notes
