"""Megatron-LM's saved ``args`` -> megalm model config fields, refusing what megalm cannot represent.

Read from the checkpoint's own ``args`` (``common.pt`` / ``model_optim_rng.pt``, see
:mod:`megalm.conversion.megatron_pickles`): the architecture (layers, sizes, heads, query groups,
``kv_channels``, norm, SwiGLU or squared ReLU, biases, tied or untied output, positions and RoPE base/percent,
qk-layernorm, ``apply_layernorm_1p``), the dropouts, the init std, ``seq_length`` and the padded
vocabulary; for mixture-of-experts models the expert count, sizes, layer pattern, router (top-k, score
function, group-limited routing, scaling, expert bias, dtype), shared expert and the training-only
settings (losses, dispatcher, capacity), which megalm flags may override (:data:`MOE_TRAINING_FIELDS`);
gpt-oss's sliding windows, softmax sinks, clamped quick-GEGLU and YaRN settings (:data:`GPTOSS_FIELDS`: Megatron's
argument names are megalm's field names).
megatron-core 0.19's parser stores ``--norm-epsilon`` as ``layernorm_epsilon`` and
``--apply-layernorm-1p`` as ``layernorm_zero_centered_gamma``: either name is read.
Megatron's default fused bias-GELU (``bias_gelu_fusion`` with biases) and
``--openai-gelu`` compute the tanh approximation of GELU: such models get megalm's
``--openai-gelu``; ``--no-bias-gelu-fusion`` runs (or no biases) keep the exact erf GELU.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from megalm.conversion.errors import ConversionError

# args that must be off (False / None / 0 / the default) for megalm to hold the same model: (name, why).
_MUST_BE_OFF = (
    ("moe_shared_expert_gate", "megalm's shared expert has no gate"),
    ("moe_input_jitter_eps", "megalm's router adds no input jitter"),
    ("moe_router_topk_limited_devices", "use --moe-router-num-groups / --moe-router-group-topk"),
    ("moe_apply_probs_on_input", "megalm weights the experts' outputs, not their inputs"),
    ("moe_extended_tp", "megalm never splits experts over tensor-parallel ranks"),
    ("multi_latent_attention", "megalm has no multi-latent attention"),
    ("mtp_num_layers", "megalm has no multi-token prediction layers"),
    ("rotary_interleaved", "megalm's RoPE rotates halves, not interleaved pairs"),
    ("use_rope_scaling", "megalm implements plain RoPE only"),
    ("rotary_seq_len_interpolation_factor", "megalm implements plain RoPE only"),
    ("apply_residual_connection_post_layernorm", "megalm's residual adds the layer input"),
    ("heterogeneous_layers_config_path", "megalm's layers are all alike"),
    ("qk_l2_norm", "megalm's --qk-layernorm uses --normalization"),
    ("no_rope_freq", "megalm applies RoPE in every layer"),
    ("attention_output_gate", "megalm's attention has no output gate"),
    ("use_legacy_models", "megalm reads Megatron-core (mcore) models only"),
)


def _get(args: dict, name: str, default=None):
    value = args.get(name, default)
    return default if value is None else value


def tanh_gelu(args: dict) -> bool:
    """Whether Megatron's GELU MLP computed the tanh approximation (``--openai-gelu``, or the default
    fused bias-GELU ``bias_gelu_impl``, which Megatron turns off without biases)."""
    if args.get("swiglu") or args.get("squared_relu") or args.get("quick_geglu"):
        return False
    fused = bool(_get(args, "bias_gelu_fusion", True)) and bool(_get(args, "add_bias_linear", True))
    return bool(args.get("openai_gelu")) or fused


def refusals(args: dict) -> List[str]:
    """``--flag value (why)`` for each saved arg megalm cannot represent."""
    wrong = []
    for name, why in _MUST_BE_OFF:
        value = args.get(name)
        if value not in (None, False, 0, "", []):
            wrong.append(f"--{name.replace('_', '-')} {value} ({why})")
    pos = _get(args, "position_embedding_type", "learned_absolute")
    if pos not in ("learned_absolute", "rope", "yarn", "none"):
        wrong.append(f"--position-embedding-type {pos} (megalm has learned_absolute, rope, yarn and none)")
    norm = _get(args, "normalization", "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        wrong.append(f"--normalization {norm} (megalm has LayerNorm and RMSNorm)")
    softmax = _get(args, "softmax_type", "vanilla")
    if softmax not in ("vanilla", "off-by-one", "learnable"):
        wrong.append(f"--softmax-type {softmax} (megalm has vanilla, off-by-one and learnable)")
    if args.get("num_experts"):
        wrong += _moe_refusals(args)
    if args.get("group_query_attention") and not args.get("num_query_groups"):
        wrong.append("--group-query-attention without --num-query-groups")
    return wrong


def _moe_refusals(args: dict) -> List[str]:
    wrong = []
    balancing = _get(args, "moe_router_load_balancing_type", "aux_loss")
    if isinstance(balancing, (list, tuple)):
        balancing = balancing[0] if len(balancing) == 1 else balancing
    if balancing not in ("aux_loss", "seq_aux_loss", "none"):
        wrong.append(f"--moe-router-load-balancing-type {balancing} (megalm has aux_loss, seq_aux_loss and none)")
    score = _get(args, "moe_router_score_function", "softmax")
    if score not in ("softmax", "sigmoid"):
        wrong.append(f"--moe-router-score-function {score} (megalm has softmax and sigmoid)")
    freq = _get(args, "moe_layer_freq", 1)
    if not isinstance(freq, (int, list, tuple)):
        wrong.append(f"--moe-layer-freq {freq!r} (an int or a list of 0/1 per layer)")
    return wrong


# MoE settings that only change training (losses, dispatch, capacity): megalm flags may override them.
MOE_TRAINING_FIELDS = (
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_bias_update_rate",
    "moe_token_dispatcher_type",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity",
    "moe_grouped_gemm",
)


def moe_fields(args: dict) -> dict:
    """megalm's MoE model fields from Megatron's saved ``args`` (``num_experts`` set)."""
    balancing = _get(args, "moe_router_load_balancing_type", "aux_loss")
    coeff = _get(args, "moe_aux_loss_coeff", 0.0)
    dispatcher = _get(args, "moe_token_dispatcher_type", "allgather")
    freq = _get(args, "moe_layer_freq", 1)
    return {
        "num_experts": int(args["num_experts"]),
        "moe_ffn_hidden_size": _get(args, "moe_ffn_hidden_size"),
        "moe_layer_freq": freq if isinstance(freq, int) else [int(v) for v in freq],
        "moe_router_topk": int(_get(args, "moe_router_topk", 2)),
        "moe_router_score_function": _get(args, "moe_router_score_function", "softmax"),
        "moe_router_pre_softmax": bool(args.get("moe_router_pre_softmax")),
        "moe_router_num_groups": _get(args, "moe_router_num_groups"),
        "moe_router_group_topk": _get(args, "moe_router_group_topk"),
        "moe_router_topk_scaling_factor": _get(args, "moe_router_topk_scaling_factor"),
        "moe_router_enable_expert_bias": bool(args.get("moe_router_enable_expert_bias")),
        "moe_router_bias_update_rate": float(_get(args, "moe_router_bias_update_rate", 1e-3)),
        "moe_router_dtype": _get(args, "moe_router_dtype"),
        "moe_shared_expert_intermediate_size": _get(args, "moe_shared_expert_intermediate_size"),
        "moe_router_load_balancing_type": balancing[0] if isinstance(balancing, (list, tuple)) else balancing,
        "moe_aux_loss_coeff": float(coeff[0] if isinstance(coeff, (list, tuple)) else coeff),
        "moe_z_loss_coeff": _get(args, "moe_z_loss_coeff"),
        # flex (DeepEP / HybridEP) moves the same tokens as alltoall
        "moe_token_dispatcher_type": "alltoall" if dispatcher == "flex" else dispatcher,
        "moe_expert_capacity_factor": _get(args, "moe_expert_capacity_factor"),
        "moe_token_drop_policy": _get(args, "moe_token_drop_policy", "probs"),
        "moe_pad_expert_input_to_capacity": bool(args.get("moe_pad_expert_input_to_capacity")),
        "moe_grouped_gemm": bool(args.get("moe_grouped_gemm")),
    }


# gpt-oss's args (sliding windows, softmax sinks, the clamped quick-GEGLU, YaRN): Megatron's names are megalm's
# fields (megalm/config/gptoss.py); each is recorded when the saved args set it.
GPTOSS_FIELDS = (
    "window_size",
    "window_attn_skip_freq",
    "softmax_type",
    "quick_geglu",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "rope_type",
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_correction_range_round_to_int",
    "enable_gpt_oss",
)


def gptoss_fields(args: dict) -> dict:
    """megalm's fields of the gpt-oss args that the saved ``args`` hold (tuples as lists)."""
    out = {}
    for name in GPTOSS_FIELDS:
        value = args.get(name)
        if value is not None:
            out[name] = [int(v) for v in value] if isinstance(value, (list, tuple)) else value
    if out.get("window_attn_skip_freq") is None and "window_size" not in out:
        out.pop("window_attn_skip_freq", None)
    return out


def megalm_fields(args: dict, source: str, vocab_size: int) -> Tuple[dict, List[str]]:
    """``(megalm ModelConfig fields, notes)`` from Megatron's ``args`` (read from ``source``)."""
    wrong = refusals(args)
    if wrong:
        raise ConversionError(f"{source}: megalm cannot represent this Megatron-LM model: {'; '.join(wrong)}")
    heads, hidden = int(args["num_attention_heads"]), int(args["hidden_size"])
    kv = args.get("kv_channels")
    gqa = bool(args.get("group_query_attention"))
    pos = _get(args, "position_embedding_type", "learned_absolute")
    if pos == "learned_absolute" and args.get("add_position_embedding") is False:
        pos = "none"
    seq = int(args["seq_length"])
    fields = {
        "num_layers": int(args["num_layers"]),
        "hidden_size": hidden,
        "ffn_hidden_size": int(_get(args, "ffn_hidden_size", 4 * hidden)),
        "num_attention_heads": heads,
        "kv_channels": None if kv in (None, hidden // heads) else int(kv),
        "group_query_attention": gqa,
        "num_query_groups": int(args["num_query_groups"]) if gqa else None,
        "max_position_embeddings": int(_get(args, "max_position_embeddings", seq)),
        "position_embedding_type": pos,
        "rotary_base": int(_get(args, "rotary_base", 10000)),
        "rotary_percent": float(_get(args, "rotary_percent", 1.0)),
        "normalization": _get(args, "normalization", "LayerNorm"),
        "norm_epsilon": float(_get(args, "norm_epsilon", _get(args, "layernorm_epsilon", 1e-5))),
        "apply_layernorm_1p": bool(args.get("apply_layernorm_1p") or args.get("layernorm_zero_centered_gamma")),
        "swiglu": bool(args.get("swiglu")),
        "squared_relu": bool(args.get("squared_relu")),
        "openai_gelu": tanh_gelu(args),
        "add_bias_linear": bool(_get(args, "add_bias_linear", True)),
        "add_qkv_bias": bool(args.get("add_qkv_bias")),
        "qk_layernorm": bool(args.get("qk_layernorm")),
        "untie_embeddings_and_output_weights": bool(args.get("untie_embeddings_and_output_weights")),
        "hidden_dropout": float(_get(args, "hidden_dropout", 0.1)),
        "attention_dropout": float(_get(args, "attention_dropout", 0.1)),
        "init_method_std": float(_get(args, "init_method_std", 0.02)),
        "make_vocab_size_divisible_by": int(_get(args, "make_vocab_size_divisible_by", 128)),
        "vocab_size": vocab_size,
    }
    fields.update(gptoss_fields(args))
    if fields.get("quick_geglu"):
        fields["openai_gelu"] = False  # a gated MLP: Megatron's GELU fusion does not apply
    notes = []
    if args.get("num_experts"):
        fields.update(moe_fields(args))
        notes.append(
            f"mixture of experts: {fields['num_experts']} experts, top-{fields['moe_router_topk']} "
            f"{fields['moe_router_score_function']} routing (training-only MoE settings may be overridden by flags)"
        )
    if fields["openai_gelu"]:
        why = "--openai-gelu" if args.get("openai_gelu") else "its default fused bias-GELU"
        notes.append(f"Megatron's GELU here is the tanh approximation ({why}): recorded as megalm's --openai-gelu")
    return fields, notes


def true_vocab_size(args: dict, given: Optional[int], tokenizer_vocab: Optional[int]) -> Tuple[int, str]:
    """``(vocabulary size, where it came from)``: ``--vocab-size``, then the tokenizer the saved args
    name (when readable here), then Megatron's saved ``vocab_size`` (its ``NullTokenizer`` adds the
    end-of-document id: ``vocab_size + 1`` rows); the padded embedding rows are trimmed to it."""
    padded = args.get("padded_vocab_size")
    saved = args.get("vocab_size")
    null = args.get("tokenizer_type") == "NullTokenizer"
    if saved and null:
        saved, saved_where = int(saved) + 1, "the saved args' vocab_size + 1 (NullTokenizer's end-of-document id)"
    else:
        saved_where = "the saved args' vocab_size"
    for value, where in (
        (given, "--vocab-size"),
        (tokenizer_vocab, "the tokenizer named in the saved args"),
        (saved, saved_where),
    ):
        if value:
            if padded and int(value) > int(padded):
                raise ConversionError(f"{where} {value} is larger than the saved padded vocabulary {padded}")
            return int(value), where
    raise ConversionError(
        f"cannot tell the true vocabulary size (the checkpoint holds the padded {padded} rows and its "
        f"tokenizer files are not readable here): give --vocab-size N, or --tokenizer-type with its files"
    )
