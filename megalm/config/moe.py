"""The mixture-of-experts flags of :class:`~megalm.config.model.ModelConfig` (``--num-experts``,
``--moe-*``) checked against themselves; against the expert-parallel layout in
:mod:`megalm.config.cross`."""

from __future__ import annotations

from megalm.config.fields import check
from megalm.log import get_logger

logger = get_logger(__name__)


def validate_moe(m) -> None:
    """Router, capacity, losses and layer frequency; sets ``moe_ffn_hidden_size`` (default: the FFN width)."""
    if m.num_experts is None:
        return
    e = m.num_experts
    check(e >= 1, f"--num-experts must be >= 1, got {e}")
    check(1 <= m.moe_router_topk <= e, f"--moe-router-topk {m.moe_router_topk} must be in [1, --num-experts {e}]")
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    check(m.moe_ffn_hidden_size > 0, f"--moe-ffn-hidden-size must be positive, got {m.moe_ffn_hidden_size}")
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        check(freq >= 1, f"--moe-layer-freq {freq} must be >= 1")
    else:
        check(
            isinstance(freq, list) and len(freq) == m.num_layers and all(v in (0, 1) for v in freq),
            f"--moe-layer-freq {freq} must have one 0/1 entry per layer (--num-layers {m.num_layers})",
        )
    validate_moe_routing_recipes(m)
    if m.moe_router_score_function != "softmax" and m.moe_router_pre_softmax:
        logger.warning(
            "--moe-router-pre-softmax is ignored with --moe-router-score-function %s (as in Megatron-LM): "
            "scores are the %s of the logits, top-k taken after",
            m.moe_router_score_function,
            m.moe_router_score_function,
        )
        m.moe_router_pre_softmax = False
    check(m.moe_aux_loss_coeff >= 0.0, f"--moe-aux-loss-coeff must be >= 0, got {m.moe_aux_loss_coeff}")
    check(
        m.moe_z_loss_coeff is None or m.moe_z_loss_coeff >= 0.0,
        f"--moe-z-loss-coeff must be >= 0, got {m.moe_z_loss_coeff}",
    )
    cf = m.moe_expert_capacity_factor
    check(cf is None or cf > 0.0, f"--moe-expert-capacity-factor must be positive, got {cf}")
    check(
        cf is not None or not m.moe_pad_expert_input_to_capacity,
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    )


def validate_moe_routing_recipes(m) -> None:
    """Group-limited routing, the weight scaling factor and the aux-loss-free expert bias."""
    e, k, groups, group_topk = m.num_experts, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk
    check((groups is None) == (group_topk is None), "--moe-router-num-groups and --moe-router-group-topk go together")
    if groups is not None:
        check(
            groups >= 1 and e % groups == 0,
            f"--num-experts {e} is not divisible by --moe-router-num-groups {groups}",
        )
        check(1 <= group_topk <= groups, f"--moe-router-group-topk {group_topk} must be in [1, {groups}]")
        check(
            group_topk <= k <= group_topk * (e // groups),
            f"--moe-router-topk {k} must be between --moe-router-group-topk {group_topk} and the experts of the "
            f"chosen groups ({group_topk} x {e // groups})",
        )
    if m.moe_router_topk_scaling_factor is not None:
        check(m.moe_router_topk_scaling_factor > 0, "--moe-router-topk-scaling-factor must be positive")
    if m.moe_router_enable_expert_bias:
        check(
            m.moe_router_score_function == "sigmoid",
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in Megatron-LM)",
        )
        check(m.moe_router_bias_update_rate >= 0, "--moe-router-bias-update-rate must be >= 0")
