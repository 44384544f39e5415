"""The checks of :class:`~megalm.config.model.ModelConfig` that need nothing but its own fields
(dense architecture: sizes, heads, MLA, positions, dropout, recompute, attention core, activation
offloading, fp8; then the MoE fields' checks, :mod:`megalm.config.moe`), with the values they
derive (FFN width, ``--max-position-embeddings``, ``--rope-type``...).  Against the parallel layout:
:mod:`megalm.config.cross`."""

from __future__ import annotations

from megalm.config.fields import check

RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts", "mla_up_proj")


def validate_model(m) -> None:
    """Sizes, heads, FFN width (derived), positions, dropout, recompute, attention core, activation
    offloading, fp8 settings and the MoE flags, each against this section alone."""
    for name, value in (
        ("num_layers", m.num_layers),
        ("hidden_size", m.hidden_size),
        ("num_attention_heads", m.num_attention_heads),
        ("seq_length", m.seq_length),
    ):
        check(value > 0, f"--{name.replace('_', '-')} must be positive, got {value}")
    _heads(m)
    _mla(m)
    if m.mtp_num_layers is not None:
        check(m.mtp_num_layers >= 1, f"--mtp-num-layers must be >= 1, got {m.mtp_num_layers}")
    if not m.add_position_embedding and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "none"  # Megatron's --no-position-embedding
    if m.recompute_activations:
        check(
            m.recompute_granularity in (None, "selective"),
            f"--recompute-activations means --recompute-granularity selective, not {m.recompute_granularity}",
        )
        m.recompute_granularity = "selective"
    if m.ffn_hidden_size is None:
        glu = m.swiglu or m.quick_geglu
        ffn = int((4 * m.hidden_size * 2 / 3) / 64) * 64 if glu else 4 * m.hidden_size
        m.ffn_hidden_size = max(ffn, 64 if glu else ffn)
    check(
        not (m.openai_gelu and (m.swiglu or m.quick_geglu)),
        "--openai-gelu selects the GELU of a GELU MLP; with --swiglu the MLP has no GELU: drop one of them",
    )
    if m.squared_relu:
        others = (("--swiglu", m.swiglu), ("--quick-geglu", m.quick_geglu), ("--openai-gelu", m.openai_gelu))
        given = [flag for flag, on in others if on]
        check(not given, f"--squared-relu and {' / '.join(given)} each choose the MLP's activation: give one")
    if m.position_embedding_type == "rope" and not m.multi_latent_attention:
        rot = int(m.head_dim * m.rotary_percent)
        check(
            rot % 2 == 0 and rot > 0,
            f"rotary dimension {rot} (head dim {m.head_dim} x --rotary-percent "
            f"{m.rotary_percent}) must be a positive even number",
        )
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.position_embedding_type == "learned_absolute":
        check(
            m.seq_length <= m.max_position_embeddings,
            f"--seq-length {m.seq_length} is longer than --max-position-embeddings "
            f"{m.max_position_embeddings} with learned absolute positions",
        )
    for name, value in (("hidden_dropout", m.hidden_dropout), ("attention_dropout", m.attention_dropout)):
        check(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1)")
    _recompute(m)
    _attention_core(m)
    _activation_offloading(m)
    _fp8(m)
    from megalm.config.moe import validate_moe  # the MoE fields' checks, in their own file

    validate_moe(m)


def _heads(m) -> None:
    """Attention heads and query groups (their split over tensor-parallel ranks: cross-section)."""
    if m.kv_channels is None and not m.multi_latent_attention:
        check(
            m.hidden_size % m.num_attention_heads == 0,
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}",
        )
    if not m.group_query_attention:
        m.num_query_groups = None
        return
    check(
        m.num_query_groups is not None and m.num_query_groups > 0,
        "--group-query-attention needs --num-query-groups",
    )
    check(
        m.num_attention_heads % m.num_query_groups == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.num_query_groups}",
    )


def _mla(m) -> None:
    """--multi-latent-attention's sizes, and --rope-type's default (yarn under MLA, as Megatron's MLA config)."""
    if m.rope_type is None:
        m.rope_type = "yarn" if m.multi_latent_attention else "rope"
    check(
        m.rotary_scaling_factor >= 1.0,
        f"--rotary-scaling-factor must be >= 1, got {m.rotary_scaling_factor}",
    )
    if not m.multi_latent_attention:
        return
    check(
        m.position_embedding_type == "rope",
        f"--multi-latent-attention needs --position-embedding-type rope (got {m.position_embedding_type})",
    )
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(m, name)
        check(value > 0, f"--{name.replace('_', '-')} must be positive with --multi-latent-attention, got {value}")
    check(
        m.q_lora_rank is None or m.q_lora_rank > 0,
        f"--q-lora-rank must be positive (or unset) with --multi-latent-attention, got {m.q_lora_rank}",
    )
    check(
        m.qk_pos_emb_head_dim % 2 == 0,
        f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim} must be even (it carries RoPE)",
    )
    check(
        not m.group_query_attention,
        "--group-query-attention does not apply to --multi-latent-attention (keys and values come from one "
        "latent per position, expanded to every head): drop it",
    )


def _recompute(m) -> None:
    if m.recompute_modules is not None:
        other = [x for x in m.recompute_modules if x not in RECOMPUTE_MODULES]
        check(
            not other,
            f"--recompute-modules {' '.join(other)} is not a recomputable module (choose from "
            f"{', '.join(RECOMPUTE_MODULES)})",
        )
        check(
            m.recompute_granularity == "selective",
            "--recompute-modules needs --recompute-granularity selective (or --recompute-activations)",
        )
    if m.recompute_granularity == "full":
        check(
            m.recompute_method is not None,
            "--recompute-granularity full needs --recompute-method {uniform,block}",
        )
        check(
            m.recompute_num_layers is not None and m.recompute_num_layers >= 1,
            "--recompute-granularity full needs --recompute-num-layers >= 1",
        )
    elif m.recompute_method is not None:
        check(False, f"--recompute-method {m.recompute_method} needs --recompute-granularity full")


def _attention_core(m) -> None:
    """--use-flash-attn (Megatron's spelling) and the keyed dropout's core."""
    if m.use_flash_attn:
        check(
            m.attention_backend in ("auto", "flash"),
            f"--use-flash-attn contradicts --attention-backend {m.attention_backend}: give one of them",
        )
        m.attention_backend = "flash"
    check(
        not m.position_keyed_attention_dropout
        or (m.attention_backend != "flash" and not m.use_flash_attn and m.transformer_impl == "local"),
        "--position-keyed-attention-dropout needs megalm's attention core: not with --attention-backend flash / "
        "--use-flash-attn or --transformer-impl transformer_engine",
    )


def _activation_offloading(m) -> None:
    """--cpu-offloading (activations): the layer count (what it is not built with: cross-section)."""
    check(
        not m.cpu_offloading_weights,
        "--cpu-offloading-weights is not built: --cpu-offloading moves activations only (weights stay on the device)",
    )
    if not m.cpu_offloading:
        check(m.cpu_offloading_num_layers == 0, "--cpu-offloading-num-layers needs --cpu-offloading")
        return
    n = m.cpu_offloading_num_layers
    check(
        1 <= n < m.num_layers,
        f"--cpu-offloading-num-layers must be in [1, --num-layers - 1] = [1, {m.num_layers - 1}], got {n} "
        "(as Megatron-LM: the last layer's backward comes first, its activations would come straight back)",
    )
    check(
        m.recompute_granularity is None,
        "--cpu-offloading with --recompute-granularity is not supported: recomputed layers keep no activations",
    )


def _fp8(m) -> None:
    """``--fp8-*``: Transformer Engine layers and the delayed-scaling settings (GEMM shapes: cross-section)."""
    if m.fp8_format is None:
        return
    check(
        m.transformer_impl == "transformer_engine",
        f"--fp8-format {m.fp8_format} needs --transformer-impl transformer_engine "
        f"(fp8 runs inside Transformer Engine's layers)",
    )
    check(
        m.fp8_margin >= 0 and m.fp8_amax_history_len >= 1,
        f"--fp8-margin must be >= 0 and --fp8-amax-history-len >= 1, got {m.fp8_margin} and {m.fp8_amax_history_len}",
    )
    check(
        m.recompute_granularity != "full",
        "--fp8-format with --recompute-granularity full is not supported "
        "(megalm's recompute does not replay TE's fp8 scaling state); use "
        "--recompute-granularity selective or no recompute",
    )
