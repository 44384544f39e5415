"""Mixtral-style megalm mixture-of-experts models <-> ``MixtralForCausalLM``.

A Mixtral model is a Llama model (RoPE over the whole head, RMSNorm, GQA, untied or tied
output) without biases whose every MLP is a mixture of SwiGLU experts.  Embedding, norms and
attention are mapped by :class:`~megalm.conversion.llama.Llama` (this class subclasses it and
replaces only the MLP of each layer).

Tensor mapping of the MLP of layer ``i`` (HF prefix ``model.layers.{i}.block_sparse_moe.``, the
file format of the original checkpoints, which transformers 4.x reads and 5.x writes with
``save_pretrained``; on import the 5.x in-memory names ``mlp.gate.weight`` /
``mlp.experts.gate_up_proj`` ``[E, 2F, h]`` / ``mlp.experts.down_proj`` ``[E, h, F]`` are read too)::

    mlp.router.weight [E, h]                                   <-> gate.weight
    mlp.experts.local_experts.{j}.linear_fc1.weight [2F, h]    <-> experts.{j}.w1.weight (rows :F, gate)
                                                                   experts.{j}.w3.weight (rows F:, up)
    mlp.experts.local_experts.{j}.linear_fc2.weight [h, F]     <-> experts.{j}.w2.weight

megalm's checkpoints key experts by GLOBAL index ``j`` whatever the expert-parallel size, so
export reads any EP/TP/PP layout and import writes a checkpoint every layout loads.

Routing.  transformers' ``MixtralTopKRouter``: ``p = softmax(logits)`` over all E experts (fp32),
top-k of ``p``, the k weights divided by their sum.  Since softmax is monotonic and
``p_i / sum_{top-k} p = exp(l_i) / sum_{top-k} exp(l)``, this is exactly megalm's default
router (``--moe-router-score-function softmax`` without ``--moe-router-pre-softmax``: top-k of
the logits, softmax over the k chosen).  ``--moe-router-pre-softmax`` does NOT renormalize (its
k weights sum to less than 1) and is refused unless k = E; sigmoid scores are refused.

Also refused (they change the forward pass and Mixtral cannot express them): biases, layers
without experts (``--moe-layer-freq``), shared experts, expert capacity (token dropping), GELU
experts.  Training-only settings do not change the exported model's outputs and are reported:
``router_aux_loss_coef`` is ``--moe-aux-loss-coeff`` (transformers computes one switch loss over
all layers with counts normalized by tokens, i.e. k times megalm's per-layer loss, and adds it
only with ``output_router_logits``), megalm's z-loss and ``seq_aux_loss`` have no Mixtral field.
Imports refuse ``sliding_window`` (megalm attends to the whole causal context) and a non-zero
``router_jitter_noise``.
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch

from megalm.conversion.base import ROUTER, NamedTensors, expert, get_field, layer, moe_layers
from megalm.conversion.errors import ConversionError
from megalm.conversion.llama import Llama

_HF_KEYS_DROPPED = ("attention_bias", "mlp_bias", "pretraining_tp", "rope_scaling")


class Mixtral(Llama):
    name = "mixtral"
    hf_class = "MixtralForCausalLM"
    hf_model_types = ("mixtral",)
    moe = True
    overridable_fields = ("moe_aux_loss_coeff",)

    def megalm_mismatches(self, m) -> List[str]:
        wrong = super().megalm_mismatches(m)
        e, k = m.num_experts, m.moe_router_topk
        if m.add_bias_linear:
            wrong.append("biases on linear layers (Mixtral has none: needs --disable-bias-linear)")
        pattern = moe_layers(m)
        if not all(pattern):
            dense = [i for i, is_moe in enumerate(pattern) if not is_moe]
            wrong.append(
                f"--moe-layer-freq {m.moe_layer_freq} leaves layers {dense} dense (Mixtral has experts in every layer)"
            )
        if m.moe_router_score_function != "softmax":
            wrong.append(f"--moe-router-score-function {m.moe_router_score_function} (Mixtral routes by softmax)")
        elif m.moe_router_pre_softmax and k != e:
            wrong.append(
                f"--moe-router-pre-softmax with --moe-router-topk {k} < --num-experts {e} (its top-k "
                f"weights are not renormalized; Mixtral's are)"
            )
        if m.moe_shared_expert_intermediate_size:
            wrong.append(
                f"--moe-shared-expert-intermediate-size {m.moe_shared_expert_intermediate_size} "
                f"(Mixtral has no shared experts)"
            )
        if m.moe_expert_capacity_factor is not None:
            wrong.append(
                f"--moe-expert-capacity-factor {m.moe_expert_capacity_factor} (drops tokens; Mixtral is dropless)"
            )
        return wrong

    def hf_config(self, m, dtype_name: str, special_ids: dict) -> dict:
        config = {k: v for k, v in super().hf_config(m, dtype_name, special_ids).items() if k not in _HF_KEYS_DROPPED}
        coeff = 0.0 if m.moe_router_load_balancing_type == "none" else float(m.moe_aux_loss_coeff)
        config.update(
            {
                "architectures": [self.hf_class],
                "model_type": "mixtral",
                "intermediate_size": m.moe_ffn_hidden_size or m.ffn_hidden_size,
                "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.moe_router_topk,
                "router_aux_loss_coef": coeff,
                "router_jitter_noise": 0.0,
                "output_router_logits": False,
                "sliding_window": None,
            }
        )
        return config

    def megalm_fields(self, hf: dict) -> dict:
        experts = hf.get("num_local_experts")
        if not experts:
            raise ConversionError(
                f"config.json model_type = {hf.get('model_type')!r} is a mixture-of-experts model "
                f"but gives no num_local_experts"
            )
        for key in ("sliding_window",):
            if hf.get(key) is not None:
                raise ConversionError(
                    f"config.json {key} = {hf[key]}: megalm attends to the whole causal context "
                    f"(set it to null if the model was trained without a window)"
                )
        jitter = float(get_field(hf, "router_jitter_noise", 0.0))
        if jitter:
            raise ConversionError(
                f"config.json router_jitter_noise = {jitter}: megalm's router has no input jitter "
                f"(set it to 0.0 to import without it)"
            )
        topk = int(get_field(hf, "num_experts_per_tok", 2))
        if not 1 <= topk <= int(experts):
            raise ConversionError(
                f"config.json num_experts_per_tok = {topk} must be in [1, num_local_experts {experts}]"
            )
        fields = super().megalm_fields(hf)
        fields.update(
            {
                "add_bias_linear": False,
                "num_experts": int(experts),
                "moe_router_topk": topk,
                "moe_ffn_hidden_size": fields["ffn_hidden_size"],
                "moe_layer_freq": 1,
                "moe_router_score_function": "softmax",
                "moe_router_pre_softmax": False,
                "moe_shared_expert_intermediate_size": None,
                "moe_expert_capacity_factor": None,
                "moe_pad_expert_input_to_capacity": False,
                "moe_aux_loss_coeff": float(get_field(hf, "router_aux_loss_coef", 0.001)),
            }
        )
        return fields

    # --- the MLP of one layer --------------------------------------------------------------------

    def mlp_names(self, m, i: int) -> List[str]:
        return [layer(i, ROUTER)] + [
            layer(i, expert(j, f"linear_fc{n}.weight")) for j in range(m.num_experts) for n in (1, 2)
        ]

    def mlp_to_hf(self, m, i: int, t: Dict[str, torch.Tensor]) -> NamedTensors:
        hf = f"model.layers.{i}.block_sparse_moe."
        yield hf + "gate.weight", t[layer(i, ROUTER)]
        for j in range(m.num_experts):
            fc1 = t[layer(i, expert(j, "linear_fc1.weight"))]
            f = fc1.shape[0] // 2
            yield hf + f"experts.{j}.w1.weight", fc1[:f].contiguous()
            yield hf + f"experts.{j}.w2.weight", t[layer(i, expert(j, "linear_fc2.weight"))]
            yield hf + f"experts.{j}.w3.weight", fc1[f:].contiguous()

    def mlp_to_megalm(self, m, i: int, get: Callable[[str], torch.Tensor], hf_keys: List[str]) -> NamedTensors:
        keys = set(hf_keys)
        base = f"model.layers.{i}."
        prefix = next((base + p for p in ("block_sparse_moe.", "mlp.") if base + p + "gate.weight" in keys), None)
        if prefix is None:
            raise ConversionError(
                f"the Hugging Face weights have no router for layer {i} ({base}block_sparse_moe."
                f"gate.weight or {base}mlp.gate.weight): not a Mixtral mixture-of-experts model"
            )
        yield layer(i, ROUTER), get(prefix + "gate.weight")
        if prefix + "experts.gate_up_proj" in keys:  # transformers 5.x fused layout
            gate_up, down = get(prefix + "experts.gate_up_proj"), get(prefix + "experts.down_proj")
            if gate_up.shape[0] != m.num_experts or down.shape[0] != m.num_experts:
                raise ConversionError(
                    f"{prefix}experts.gate_up_proj / down_proj hold {gate_up.shape[0]} / "
                    f"{down.shape[0]} experts, config.json num_local_experts is {m.num_experts}"
                )
            for j in range(m.num_experts):
                yield layer(i, expert(j, "linear_fc1.weight")), gate_up[j].contiguous()  # [gate; up] already
                yield layer(i, expert(j, "linear_fc2.weight")), down[j].contiguous()
            return
        for j in range(m.num_experts):
            w = prefix + f"experts.{j}."
            yield layer(i, expert(j, "linear_fc1.weight")), torch.cat([get(w + "w1.weight"), get(w + "w3.weight")])
            yield layer(i, expert(j, "linear_fc2.weight")), get(w + "w2.weight")

    # --- what the user should know ---------------------------------------------------------------

    def export_notes(self, m) -> List[str]:
        notes = [
            f"router: {m.num_experts} experts, top-{m.moe_router_topk}, softmax renormalized over the "
            f"top-k (= megalm's router); router_aux_loss_coef = --moe-aux-loss-coeff (transformers applies it "
            f"to one loss over all layers, k times megalm's per-layer normalization, and only with "
            f"output_router_logits)"
        ]
        if m.moe_router_load_balancing_type == "seq_aux_loss":
            notes.append("--moe-router-load-balancing-type seq_aux_loss: Mixtral's load-balancing loss is per batch")
        if m.moe_z_loss_coeff:
            notes.append(f"--moe-z-loss-coeff {m.moe_z_loss_coeff}: Mixtral has no router z-loss (training only)")
        if m.moe_router_dtype:
            notes.append(
                f"--moe-router-dtype {m.moe_router_dtype}: transformers computes router logits in the model's dtype"
            )
        return notes

    def import_notes(self, hf: dict) -> List[str]:
        coeff = float(get_field(hf, "router_aux_loss_coef", 0.001))
        return [
            f"router: {hf['num_local_experts']} experts, top-{get_field(hf, 'num_experts_per_tok', 2)} "
            f"(megalm's default softmax router gives Mixtral's weights); router_aux_loss_coef {coeff:g} recorded "
            f"as --moe-aux-loss-coeff (megalm sums per-layer losses normalized by tokens x k; override with "
            f"--moe-aux-loss-coeff)"
        ]
