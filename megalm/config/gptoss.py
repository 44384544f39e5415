"""Checks and derived values of the gpt-oss flags: sliding-window attention, softmax sinks, the clamped
gated MLP and YaRN rotary embeddings (Megatron-LM's flag names and meanings).

- ``--window-size L,R`` with ``--window-attn-skip-freq``: :func:`layer_window` gives a layer's left window
  (Megatron's ``is_layer_window_attention``: 1-based layer ``n`` slides unless ``n % N == 0``, or per the
  0/1 list).
- ``--softmax-type off-by-one|learnable``: a sink logit (0, or a learned one per head) in every row's
  softmax denominator.
- ``--quick-geglu`` / ``--glu-linear-offset`` / ``--activation-func-clamp-value``: the gated MLP
  ``quick_gelu(min(x1, c)) * (clamp(x2, -c, c) + offset)``.
- YaRN: ``--position-embedding-type yarn`` (Megatron's non-MLA spelling) becomes ``rope`` with
  ``--rope-type yarn``, and ``--yarn-original-max-position-embeddings`` / ``--yarn-beta-fast/slow`` fill
  the YaRN fields (:mod:`megalm.transformer.yarn`); ``--enable-gpt-oss`` sets Megatron's gpt-oss values.
"""

from __future__ import annotations

from typing import Optional

from megalm.config.fields import check
from megalm.config.model import ModelConfig
from megalm.config.parallel import ParallelConfig

# Megatron's ModelOpt builder (megatron/post_training/model_builder.py) under --enable-gpt-oss.
GPT_OSS_YARN = dict(
    rotary_scaling_factor=32.0,
    original_max_position_embeddings=131072,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.0,
    yarn_correction_range_round_to_int=False,
)


def layer_window(m: ModelConfig, layer_number: int) -> Optional[int]:
    """The left window of 0-based layer ``layer_number`` (query ``i`` sees keys ``i - w .. i``), or None
    for full causal attention."""
    if not m.window_size or m.window_size[0] < 0:
        return None
    freq, n = m.window_attn_skip_freq, layer_number + 1  # Megatron's layer numbers are 1-based
    if freq is None:
        return m.window_size[0]
    slides = bool(freq[n - 1]) if isinstance(freq, list) else n % freq != 0
    return m.window_size[0] if slides else None


def uses_sinks(m: ModelConfig) -> bool:
    return m.softmax_type != "vanilla"


def gated_mlp(m: ModelConfig) -> bool:
    """Whether fc1 is a fused ``[gate; up]`` pair (SwiGLU or quick-GEGLU)."""
    return m.swiglu or m.quick_geglu


def validate_gptoss(m: ModelConfig, p: ParallelConfig) -> None:
    """Fill YaRN defaults and check the window / sink / GLU flags against each other and the parallel
    layout (what the attention cores cannot run is refused here, before any rank starts)."""
    if m.position_embedding_type == "yarn":  # Megatron's non-MLA spelling: rope with YaRN frequencies
        m.position_embedding_type, m.rope_type = "rope", "yarn"
    if m.enable_gpt_oss:
        m.position_embedding_type, m.rope_type = "rope", "yarn"
        for name, value in GPT_OSS_YARN.items():
            setattr(m, name, value)
    for value, field in (
        (m.yarn_original_max_position_embeddings, "original_max_position_embeddings"),
        (m.yarn_beta_fast, "beta_fast"),
        (m.yarn_beta_slow, "beta_slow"),
    ):
        if value is not None:
            setattr(m, field, value)
    if m.yarn_correction_range_round_to_int is None:
        m.yarn_correction_range_round_to_int = True
    if m.rope_type == "yarn" and not m.multi_latent_attention:
        check(m.rotary_percent == 1.0, f"YaRN rotates whole heads: --rotary-percent must be 1, got {m.rotary_percent}")
    check(m.rotary_scaling_factor > 0, f"--rotary-scaling-factor must be positive, got {m.rotary_scaling_factor}")

    check(not (m.swiglu and m.quick_geglu), "--swiglu and --quick-geglu are two gated MLPs: give one")
    if m.glu_linear_offset or m.activation_func_clamp_value is not None:
        check(
            gated_mlp(m),
            "--glu-linear-offset / --activation-func-clamp-value apply to a gated MLP: add --swiglu or --quick-geglu",
        )
    if m.activation_func_clamp_value is not None:
        check(
            m.activation_func_clamp_value > 0,
            f"--activation-func-clamp-value must be positive, got {m.activation_func_clamp_value}",
        )

    if m.window_size is not None:
        left, right = m.window_size
        check(left >= -1, f"--window-size left must be >= 0 (or -1: unbounded), got {left}")
        check(
            right == 0,
            f"--window-size right must be 0 for a causal GPT (queries see no later keys), got {right}",
        )
    freq = m.window_attn_skip_freq
    if freq is not None:
        check(m.window_size is not None, "--window-attn-skip-freq needs --window-size")
        if isinstance(freq, list):
            check(
                len(freq) == m.num_layers and set(freq) <= {0, 1},
                f"--window-attn-skip-freq list needs one 0/1 entry per layer ({m.num_layers}), got {freq}",
            )
        else:
            check(freq >= 1, f"--window-attn-skip-freq must be >= 1, got {freq}")

    variant = (m.window_size is not None and m.window_size[0] >= 0) or uses_sinks(m)
    if not variant:
        return
    what = "--window-size / --softmax-type " + m.softmax_type
    check(not m.multi_latent_attention, f"{what} is not built for --multi-latent-attention")
    check(
        m.transformer_impl == "local",
        f"{what} runs in megalm's attention cores: use --transformer-impl local (TE's core is not wired for it)",
    )
    check(
        not m.position_keyed_attention_dropout,
        f"{what} is not supported with --position-keyed-attention-dropout (the keyed core has no window or sink)",
    )
    if p.context_parallel_size > 1:
        check(
            p.cp_comm_type in ("a2a", "allgather"),
            f"{what} under --context-parallel-size > 1 needs --cp-comm-type a2a or allgather: the ring (p2p) "
            "core has no window or sink",
        )
        check(
            m.attention_dropout == 0.0,
            f"{what} under context parallelism needs --attention-dropout 0 (CP's dropout is the keyed core's, "
            "which has no window or sink)",
        )
