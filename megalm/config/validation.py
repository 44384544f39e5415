"""Validation: :func:`validate_config` is the only place where flag combinations are checked
and derived values (FFN width, padded vocabulary, data-parallel size, ...) are set; it runs
before any process group or model exists.  Errors are :class:`ConfigError` naming the flags."""

from __future__ import annotations

import math
import os
from typing import List, Optional, Tuple

from megalm.config.fsdp import validate_fsdp_grad_dtypes
from megalm.config.gptoss import validate_gptoss
from megalm.config.megatron_compat import NO_EFFECT, given_no_effect_flags, refusal
from megalm.config.sections import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    MegalmConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
)
from megalm.data.indexed_dataset import DataError
from megalm.data.split import parse_split
from megalm.device import get_backend, use_cuda
from megalm.log import get_logger
from megalm.tokenizers.build import missing_tokenizer_flags
from megalm.training.microbatches import ScheduleError, parse_step_batch_size_schedule

logger = get_logger(__name__)

# Megatron-LM flags that have no meaning in megalm: accepted so Megatron scripts run unchanged,
# with a warning naming what megalm does instead.
MEGATRON_NO_OPS = {
    "--apply-query-key-layer-scaling": "Megatron's fp16 overflow guard inside its fused softmax; megalm's "
    "attention scales q k^T by 1/sqrt(head dim) only",
    "--log-throughput": "megalm always logs tokens per second, TFLOP/s per rank and MFU",
    "--log-validation-ppl-to-tensorboard": "megalm always logs validation perplexity (lm loss <split> ppl)",
    **NO_EFFECT,
}

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine")


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _validate_moe_routing_recipes(m: ModelConfig) -> None:
    """Group-limited routing, the weight scaling factor and the aux-loss-free expert bias."""
    e, k, groups, group_topk = m.num_experts, m.moe_router_topk, m.moe_router_num_groups, m.moe_router_group_topk
    _check((groups is None) == (group_topk is None), "--moe-router-num-groups and --moe-router-group-topk go together")
    if groups is not None:
        _check(
            groups >= 1 and e % groups == 0,
            f"--num-experts {e} is not divisible by --moe-router-num-groups {groups}",
        )
        _check(1 <= group_topk <= groups, f"--moe-router-group-topk {group_topk} must be in [1, {groups}]")
        _check(
            group_topk <= k <= group_topk * (e // groups),
            f"--moe-router-topk {k} must be between --moe-router-group-topk {group_topk} and the experts of the "
            f"chosen groups ({group_topk} x {e // groups})",
        )
    if m.moe_router_topk_scaling_factor is not None:
        _check(m.moe_router_topk_scaling_factor > 0, "--moe-router-topk-scaling-factor must be positive")
    if m.moe_router_enable_expert_bias:
        _check(
            m.moe_router_score_function == "sigmoid",
            "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (as in Megatron-LM)",
        )
        _check(m.moe_router_bias_update_rate >= 0, "--moe-router-bias-update-rate must be >= 0")


def _validate_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """Mixture-of-experts flags (needs ``ffn_hidden_size`` and ``sequence_parallel`` settled)."""
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    if m.num_experts is None:
        _check(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    e = m.num_experts
    _check(e >= 1, f"--num-experts must be >= 1, got {e}")
    _check(1 <= m.moe_router_topk <= e, f"--moe-router-topk {m.moe_router_topk} must be in [1, --num-experts {e}]")
    _check(ep >= 1 and e % ep == 0, f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}")
    _check(
        tp == 1 or p.sequence_parallel,
        f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel (each tensor-parallel rank "
        f"routes its own slice of the sequence)",
    )
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    _check(m.moe_ffn_hidden_size > 0, f"--moe-ffn-hidden-size must be positive, got {m.moe_ffn_hidden_size}")
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        _check(freq >= 1, f"--moe-layer-freq {freq} must be >= 1")
    else:
        _check(
            isinstance(freq, list) and len(freq) == m.num_layers and all(v in (0, 1) for v in freq),
            f"--moe-layer-freq {freq} must have one 0/1 entry per layer (--num-layers {m.num_layers})",
        )
    _validate_moe_routing_recipes(m)
    if m.moe_router_score_function != "softmax" and m.moe_router_pre_softmax:
        logger.warning(
            "--moe-router-pre-softmax is ignored with --moe-router-score-function %s (as in Megatron-LM): "
            "scores are the %s of the logits, top-k taken after",
            m.moe_router_score_function,
            m.moe_router_score_function,
        )
        m.moe_router_pre_softmax = False
    _check(m.moe_aux_loss_coeff >= 0.0, f"--moe-aux-loss-coeff must be >= 0, got {m.moe_aux_loss_coeff}")
    _check(
        m.moe_z_loss_coeff is None or m.moe_z_loss_coeff >= 0.0,
        f"--moe-z-loss-coeff must be >= 0, got {m.moe_z_loss_coeff}",
    )
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None:
        _check(
            shared > 0 and shared % tp == 0,
            f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
            f"--tensor-model-parallel-size {tp}",
        )
    cf = m.moe_expert_capacity_factor
    _check(cf is None or cf > 0.0, f"--moe-expert-capacity-factor must be positive, got {cf}")
    _check(
        cf is not None or not m.moe_pad_expert_input_to_capacity,
        "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
    )


def _validate_expert_tensor_parallel(m: ModelConfig, p: ParallelConfig, t: TrainingConfig) -> None:
    """``--expert-tensor-parallel-size``: absent means 1 (experts whole; Megatron's default is TP); > 1 splits
    every expert over that many ranks, with what that split is built for (the layout itself is checked
    against the world size by ``validate_layout``)."""
    etp = p.expert_tensor_parallel_size
    if etp is None or etp == 1:
        return
    flag = f"--expert-tensor-parallel-size {etp}"
    _check(etp >= 1, f"--expert-tensor-parallel-size must be >= 1, got {etp}")
    _check(m.num_experts is not None, f"{flag} needs --num-experts")
    _check(
        m.moe_ffn_hidden_size % etp == 0,
        f"{flag} must divide the experts' hidden size (--moe-ffn-hidden-size {m.moe_ffn_hidden_size})",
    )
    refused = (
        (
            t.optimizer in ("lamb", "lars", "muon"),
            f"--optimizer {t.optimizer} (its full-tensor norms and matrices do not assemble expert shards)",
        ),
        (p.local_sgd_interval > 0, "--local-sgd-interval (expert-tensor groups can span replicas)"),
        (m.cpu_offloading, "--cpu-offloading (not tested with split experts)"),
        (m.transformer_impl == "transformer_engine", "--transformer-impl transformer_engine (not tested)"),
    )
    for given, what in refused:
        _check(not given, f"{flag} is not supported with {what}")


def _validate_sharding_strategy(m: ModelConfig, p: ParallelConfig) -> None:
    """``--data-parallel-sharding-strategy`` and ``--use-distributed-optimizer`` made consistent:
    every strategy but ``no_shard`` turns the distributed optimizer on, and the distributed optimizer
    alone means ``optim``.  ``optim_grads`` and ``optim_grads_params`` are refused where they are not built."""
    s = p.data_parallel_sharding_strategy
    if s == "no_shard" and p.use_distributed_optimizer:
        p.data_parallel_sharding_strategy = s = "optim"
    if s != "no_shard":
        p.use_distributed_optimizer = True
    if s in ("no_shard", "optim"):
        return
    for flag, size in (
        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
        ("--expert-model-parallel-size", p.expert_model_parallel_size),
        ("--expert-tensor-parallel-size", p.expert_tensor_parallel_size or 1),
    ):
        _check(size == 1, f"--data-parallel-sharding-strategy {s} with {flag} {size} is not built yet")
    _check(
        not p.hierarchical_grad_reduce,
        f"--data-parallel-sharding-strategy {s} with --hierarchical-grad-reduce is not built yet",
    )
    if s != "optim_grads_params":
        return
    _check(
        m.num_experts is None,
        "--data-parallel-sharding-strategy optim_grads_params with --num-experts is not built yet (ranks whose "
        "experts get different tokens could gather in different orders)",
    )


def _validate_activation_offloading(m: ModelConfig, p: ParallelConfig) -> None:
    """--cpu-offloading (activations): what is built and tested."""
    _check(
        not m.cpu_offloading_weights,
        "--cpu-offloading-weights is not built: --cpu-offloading moves activations only (weights stay on the device)",
    )
    if not m.cpu_offloading:
        _check(m.cpu_offloading_num_layers == 0, "--cpu-offloading-num-layers needs --cpu-offloading")
        return
    n = m.cpu_offloading_num_layers
    _check(
        1 <= n < m.num_layers,
        f"--cpu-offloading-num-layers must be in [1, --num-layers - 1] = [1, {m.num_layers - 1}], got {n} "
        "(as Megatron-LM: the last layer's backward comes first, its activations would come straight back)",
    )
    refused = (
        ("--recompute-granularity", m.recompute_granularity is not None, "recomputed layers keep no activations"),
        ("--pipeline-model-parallel-size > 1", p.pipeline_model_parallel_size > 1, "not tested with pipelining"),
        ("--context-parallel-size > 1", p.context_parallel_size > 1, "not tested with context parallelism"),
        (
            "--expert-model-parallel-size > 1",
            p.expert_model_parallel_size > 1,
            "not tested with expert parallelism (MoE layers at EP 1 are)",
        ),
        (
            "--transformer-impl transformer_engine",
            m.transformer_impl == "transformer_engine",
            "TE's layers keep fp8 and fused state megalm's hooks do not offload",
        ),
        (
            "--data-parallel-sharding-strategy optim_grads_params",
            p.data_parallel_sharding_strategy == "optim_grads_params",
            "ZeRO-3 installs its own saved-tensor hooks around the forward",
        ),
    )
    for flag, given, why in refused:
        _check(not given, f"--cpu-offloading with {flag} is not supported: {why}")


def _validate_data_parallel(p: ParallelConfig, t: TrainingConfig) -> None:
    """The data-parallel wrapper's flags (megalm.distributed.data_parallel reads them unchecked)."""
    if p.grad_reduce_in_bf16:
        p.accumulate_allreduce_grads_in_fp32 = False  # DDP's buffers take the parameters' dtype: bf16
    validate_fsdp_grad_dtypes(p, t)
    _check(
        not p.overlap_param_gather or p.use_distributed_optimizer,
        "--overlap-param-gather needs --use-distributed-optimizer (it overlaps the optimizer's parameter all-gather)",
    )
    _check(
        p.ddp_bucket_size is None or p.ddp_bucket_size > 0,
        f"--ddp-bucket-size must be positive, got {p.ddp_bucket_size}",
    )
    _validate_grad_compression(p)
    _validate_local_sgd(p)


def _validate_local_sgd(p: ParallelConfig) -> None:
    """``--local-sgd-interval`` and the outer optimizer; what local SGD is not built for."""
    _check(p.local_sgd_interval >= 0, f"--local-sgd-interval must be >= 0, got {p.local_sgd_interval}")
    _check(
        p.local_sgd_overlap_steps == 0 or p.local_sgd_interval > 0,
        "--local-sgd-overlap-steps needs --local-sgd-interval",
    )
    if not p.local_sgd_interval:
        return
    _check(
        0 <= p.local_sgd_overlap_steps <= p.local_sgd_interval,
        f"--local-sgd-overlap-steps must be in [0, --local-sgd-interval] = [0, {p.local_sgd_interval}], "
        f"got {p.local_sgd_overlap_steps}",
    )
    _check(p.outer_lr > 0, f"--outer-lr must be positive, got {p.outer_lr}")
    _check(0 <= p.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {p.outer_momentum}")
    for refused, why in (
        (p.use_distributed_optimizer, "--use-distributed-optimizer (the replicas' optimizer states differ)"),
        (
            p.grad_compression != "none",
            f"--grad-compression {p.grad_compression} (no data-parallel gradient reduction)",
        ),
        (
            p.context_parallel_size > 1,
            "--context-parallel-size > 1 (context-parallel ranks of a replica must stay in step)",
        ),
        (p.expert_model_parallel_size > 1, "--expert-model-parallel-size > 1"),
    ):
        _check(not refused, f"--local-sgd-interval {p.local_sgd_interval} is not supported with {why}")


def _validate_grad_compression(p: ParallelConfig) -> None:
    """``--grad-compression`` and its method's settings."""
    if p.grad_compression == "none":
        return
    _check(p.powersgd_rank >= 1, f"--powersgd-rank must be >= 1, got {p.powersgd_rank}")
    _check(0 < p.topk_ratio <= 1, f"--topk-ratio must be in (0, 1], got {p.topk_ratio}")
    _check(p.int8_chunk_size >= 1, f"--int8-chunk-size must be >= 1, got {p.int8_chunk_size}")
    _check(p.grad_fp8_chunk_size >= 1, f"--grad-fp8-chunk-size must be >= 1, got {p.grad_fp8_chunk_size}")


def _validate_fp8(m: ModelConfig, p: ParallelConfig, t: TrainingConfig) -> None:
    """``--fp8-*``: Transformer Engine layers, delayed-scaling settings, and the shapes TE's fp8 GEMMs take."""
    if m.fp8_format is None:
        return
    _check(
        m.transformer_impl == "transformer_engine",
        f"--fp8-format {m.fp8_format} needs --transformer-impl transformer_engine "
        f"(fp8 runs inside Transformer Engine's layers)",
    )
    _check(
        m.fp8_margin >= 0 and m.fp8_amax_history_len >= 1,
        f"--fp8-margin must be >= 0 and --fp8-amax-history-len >= 1, got {m.fp8_margin} and {m.fp8_amax_history_len}",
    )
    _check(
        m.recompute_granularity != "full",
        "--fp8-format with --recompute-granularity full is not supported "
        "(megalm's recompute does not replay TE's fp8 scaling state); use "
        "--recompute-granularity selective or no recompute",
    )
    tp, heads, d = p.tensor_model_parallel_size, m.num_attention_heads, m.head_dim
    widths = {
        "hidden": m.hidden_size,
        "qkv/tp": (heads + 2 * m.num_kv_heads) * d // tp,
        "heads*d/tp": heads * d // tp,
        "ffn/tp": m.ffn_hidden_size // tp,
    }  # fc1's [gate; up] width is twice ffn/tp
    bad = {name: width for name, width in widths.items() if width % 16}
    _check(not bad, f"--fp8-format: Transformer Engine's fp8 GEMMs need widths divisible by 16, got {bad}")
    tokens = m.seq_length * t.micro_batch_size // (tp if p.sequence_parallel else 1)
    _check(
        tokens % 8 == 0,
        f"--fp8-format: Transformer Engine's fp8 GEMMs need the tokens per rank and micro-batch "
        f"(--seq-length x --micro-batch-size, / TP under sequence parallelism) divisible by 8, "
        f"got {tokens}",
    )


def validate_config(cfg: MegalmConfig, world_size: Optional[int] = None) -> MegalmConfig:
    """Check every combination and fill derived values, one config section after the other
    (later sections read values earlier ones derive).  Raises :class:`ConfigError`."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    validate_gptoss(m, p)
    _validate_model(m, p)
    vpp = _validate_pipeline(m, p)
    _validate_parallel(m, p, t)
    _validate_moe(m, p)
    _validate_expert_tensor_parallel(m, p, t)
    _validate_activation_offloading(m, p)
    _validate_optimizer_cpu_offload(t)
    _validate_precision(m, p, t)
    _validate_optimizer(p, t)
    _validate_step_schedule(m, t)
    _validate_lr_batch_scaling(t)
    if world_size is not None:
        _validate_world(p, t, world_size, vpp, m.seq_length)
    _validate_training_length(t)
    _validate_lr_schedule(t)
    _validate_data(cfg.data, m, p)
    _validate_checkpoint(cfg.checkpoint)
    _validate_logging(cfg.logging, world_size)
    if cfg.logging.wandb_project and not cfg.logging.wandb_save_dir and cfg.checkpoint.save:
        cfg.logging.wandb_save_dir = os.path.join(cfg.checkpoint.save, "wandb")  # Megatron's default
    _check_megatron_compat(cfg.megatron_compat)
    _validate_hang_watchdog(t, p)
    _warn_megatron_no_ops(cfg)
    return cfg


def _check_megatron_compat(c) -> None:
    why = refusal(c, get_backend())
    _check(why is None, why or "")


def _warn_megatron_no_ops(cfg: MegalmConfig) -> None:
    """One warning line naming every Megatron-LM flag given that has no effect here, and why."""
    given = [
        flag
        for flag, value in (
            ("--apply-query-key-layer-scaling", cfg.model.apply_query_key_layer_scaling),
            ("--log-throughput", cfg.logging.log_throughput),
            ("--log-validation-ppl-to-tensorboard", cfg.logging.log_validation_ppl_to_tensorboard),
        )
        if value
    ] + given_no_effect_flags(cfg.megatron_compat)
    if given:
        reasons = "; ".join(f"{flag} ({MEGATRON_NO_OPS[flag]})" for flag in given)
        logger.warning("Megatron-LM flags with no effect in megalm: %s", reasons)


def _validate_model(m: ModelConfig, p: ParallelConfig) -> None:
    """Sizes, heads, FFN width (derived), positions, dropout and recompute."""
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    for name, value in (
        ("num_layers", m.num_layers),
        ("hidden_size", m.hidden_size),
        ("num_attention_heads", m.num_attention_heads),
        ("seq_length", m.seq_length),
    ):
        _check(value > 0, f"--{name.replace('_', '-')} must be positive, got {value}")
    _check(tp >= 1 and pp >= 1, f"parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})")
    _validate_heads(m, tp)
    _validate_mla(m)
    _validate_mtp(m, p)
    if not m.add_position_embedding and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "none"  # Megatron's --no-position-embedding
    if m.recompute_activations:
        _check(
            m.recompute_granularity in (None, "selective"),
            f"--recompute-activations means --recompute-granularity selective, not {m.recompute_granularity}",
        )
        m.recompute_granularity = "selective"
    if m.ffn_hidden_size is None:
        glu = m.swiglu or m.quick_geglu
        m.ffn_hidden_size = int((4 * m.hidden_size * 2 / 3) / 64) * 64 if glu else 4 * m.hidden_size
        m.ffn_hidden_size = max(m.ffn_hidden_size, 64 if glu else m.ffn_hidden_size)
    _check(
        not (m.openai_gelu and (m.swiglu or m.quick_geglu)),
        "--openai-gelu selects the GELU of a GELU MLP; with --swiglu the MLP has no GELU: drop one of them",
    )
    _check(
        m.ffn_hidden_size % tp == 0,
        f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}",
    )
    if m.position_embedding_type == "rope" and not m.multi_latent_attention:
        rot = int(m.head_dim * m.rotary_percent)
        _check(
            rot % 2 == 0 and rot > 0,
            f"rotary dimension {rot} (head dim {m.head_dim} x --rotary-percent "
            f"{m.rotary_percent}) must be a positive even number",
        )
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.position_embedding_type == "learned_absolute":
        _check(
            m.seq_length <= m.max_position_embeddings,
            f"--seq-length {m.seq_length} is longer than --max-position-embeddings {m.max_position_embeddings} "
            f"with learned absolute positions",
        )
    for name, value in (("hidden_dropout", m.hidden_dropout), ("attention_dropout", m.attention_dropout)):
        _check(0.0 <= value < 1.0, f"--{name.replace('_', '-')} must be in [0, 1)")
    _validate_recompute(m)


def _validate_mla(m: ModelConfig) -> None:
    """--multi-latent-attention's sizes, and --rope-type's default (yarn under MLA, as Megatron's MLA config)."""
    if m.rope_type is None:
        m.rope_type = "yarn" if m.multi_latent_attention else "rope"
    _check(m.rotary_scaling_factor >= 1.0, f"--rotary-scaling-factor must be >= 1, got {m.rotary_scaling_factor}")
    if not m.multi_latent_attention:
        return
    _check(
        m.position_embedding_type == "rope",
        f"--multi-latent-attention needs --position-embedding-type rope (got {m.position_embedding_type})",
    )
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(m, name)
        _check(value > 0, f"--{name.replace('_', '-')} must be positive with --multi-latent-attention, got {value}")
    _check(
        m.q_lora_rank is None or m.q_lora_rank > 0,
        f"--q-lora-rank must be positive (or unset) with --multi-latent-attention, got {m.q_lora_rank}",
    )
    _check(
        m.qk_pos_emb_head_dim % 2 == 0,
        f"--qk-pos-emb-head-dim {m.qk_pos_emb_head_dim} must be even (it carries RoPE)",
    )
    _check(
        not m.group_query_attention,
        "--group-query-attention does not apply to --multi-latent-attention (keys and values come from one "
        "latent per position, expanded to every head): drop it",
    )


RECOMPUTE_MODULES = ("core_attn", "mlp", "moe", "moe_act", "layernorm", "shared_experts", "mla_up_proj")


def _validate_mtp(m: ModelConfig, p: ParallelConfig) -> None:
    """--mtp-num-layers: positive; not under context parallelism (its roll of the tokens would cross the
    CP chunks); pipelined only with RoPE (the last stage's embedding copy has no position table)."""
    if m.mtp_num_layers is None:
        return
    _check(m.mtp_num_layers >= 1, f"--mtp-num-layers must be >= 1, got {m.mtp_num_layers}")
    _check(
        p.context_parallel_size == 1,
        f"--mtp-num-layers is not supported with --context-parallel-size {p.context_parallel_size} (the shift "
        f"of the tokens by one position would cross the context-parallel chunks)",
    )
    _check(
        p.pipeline_model_parallel_size == 1 or m.position_embedding_type != "learned_absolute",
        "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs --position-embedding-type rope or none "
        "(the last stage embeds its tokens with a copy of the word embedding only)",
    )


def _validate_heads(m: ModelConfig, tp: int) -> None:
    """Attention heads and query groups split over the tensor-parallel ranks."""
    if m.kv_channels is None and not m.multi_latent_attention:
        _check(
            m.hidden_size % m.num_attention_heads == 0,
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}",
        )
    _check(
        m.num_attention_heads % tp == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}",
    )
    if not m.group_query_attention:
        m.num_query_groups = None
        return
    _check(
        m.num_query_groups is not None and m.num_query_groups > 0, "--group-query-attention needs --num-query-groups"
    )
    _check(
        m.num_attention_heads % m.num_query_groups == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.num_query_groups}",
    )
    _check(
        m.num_query_groups % tp == 0,
        f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}",
    )


def _validate_recompute(m: ModelConfig) -> None:
    if m.recompute_modules is not None:
        other = [x for x in m.recompute_modules if x not in RECOMPUTE_MODULES]
        _check(
            not other,
            f"--recompute-modules {' '.join(other)} is not a recomputable module (choose from "
            f"{', '.join(RECOMPUTE_MODULES)})",
        )
        _check(
            m.recompute_granularity == "selective",
            "--recompute-modules needs --recompute-granularity selective (or --recompute-activations)",
        )
    if m.recompute_granularity == "full":
        _check(m.recompute_method is not None, "--recompute-granularity full needs --recompute-method {uniform,block}")
        _check(
            m.recompute_num_layers is not None and m.recompute_num_layers >= 1,
            "--recompute-granularity full needs --recompute-num-layers >= 1",
        )
    elif m.recompute_method is not None:
        _check(False, f"--recompute-method {m.recompute_method} needs --recompute-granularity full")


def _validate_pipeline(m: ModelConfig, p: ParallelConfig) -> Optional[int]:
    """The layer split over pipeline stages; sets and returns the virtual pipeline size (or None)."""
    pp = p.pipeline_model_parallel_size
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        _check(pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        middle_layers = m.num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        _check(
            middle_layers >= 0
            and (middle_stages == 0 and middle_layers == 0 or middle_stages > 0 and middle_layers % middle_stages == 0),
            f"--num-layers {m.num_layers} minus first ({first}) and last ({last}) stage layers "
            f"cannot be split evenly over the other {middle_stages} pipeline stages",
        )
    else:
        _check(
            m.num_layers % pp == 0,
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}",
        )
    vpp = None
    if p.num_layers_per_virtual_pipeline_stage is not None or p.num_virtual_stages_per_pipeline_rank is not None:
        _check(
            p.num_layers_per_virtual_pipeline_stage is None or p.num_virtual_stages_per_pipeline_rank is None,
            "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank",
        )
        _check(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
        _check(first is None and last is None, "uneven first/last stages are not supported with virtual stages")
        per_rank = m.num_layers // pp
        if p.num_layers_per_virtual_pipeline_stage is not None:
            _check(
                per_rank % p.num_layers_per_virtual_pipeline_stage == 0,
                f"layers per pipeline rank ({per_rank}) is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {p.num_layers_per_virtual_pipeline_stage}",
            )
            vpp = per_rank // p.num_layers_per_virtual_pipeline_stage
        else:
            vpp = p.num_virtual_stages_per_pipeline_rank
            _check(
                per_rank % vpp == 0,
                f"layers per pipeline rank ({per_rank}) is not divisible by "
                f"--num-virtual-stages-per-pipeline-rank {vpp}",
            )
    p.virtual_pipeline_model_parallel_size = vpp
    return vpp


def _validate_parallel(m: ModelConfig, p: ParallelConfig, t: TrainingConfig) -> None:
    """Context parallelism, the data-parallel wrapper's flags and sequence parallelism."""
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    _validate_context_parallel(m, p)
    _validate_sharding_strategy(m, p)
    _check(
        cp == 1 or p.data_parallel_sharding_strategy in ("no_shard", "optim"),
        f"--data-parallel-sharding-strategy {p.data_parallel_sharding_strategy} with --context-parallel-size {cp} "
        "is not tested yet",
    )
    _validate_data_parallel(p, t)
    if p.sequence_parallel and tp == 1:
        p.sequence_parallel = False  # as Megatron: a no-op without tensor parallelism
    if p.sequence_parallel:
        per_cp = f" / --context-parallel-size {cp}" if cp > 1 else ""
        _check(
            m.seq_length // cp % tp == 0,
            f"--seq-length {m.seq_length}{per_cp} is not divisible by --tensor-model-parallel-size {tp} "
            f"(sequence parallel)",
        )


def _validate_context_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """--context-parallel-size and --cp-comm-type, and what megalm does not build under CP > 1."""
    cp = p.context_parallel_size
    _check(cp >= 1, f"--context-parallel-size must be >= 1, got {cp}")
    if cp == 1:
        return
    _check(
        m.seq_length % (2 * cp) == 0,
        f"--seq-length {m.seq_length} must be divisible by 2 x --context-parallel-size ({2 * cp}): "
        f"each CP rank holds two of 2 x CP equal chunks",
    )
    _check(
        m.transformer_impl == "local",
        "--transformer-impl transformer_engine is not supported with --context-parallel-size > 1 (use local)",
    )
    _check(
        m.attention_backend != "flash" and not m.use_flash_attn,
        "--attention-backend flash / --use-flash-attn are not supported with --context-parallel-size > 1 "
        "(the CP cores compute their own blocks; a2a runs SDPA, blocked or unfused)",
    )
    _check(
        m.moe_expert_capacity_factor is None
        or not ((p.sequence_parallel and p.tensor_model_parallel_size > 1) or m.moe_pad_expert_input_to_capacity),
        "--moe-expert-capacity-factor with --context-parallel-size > 1 is not supported with --sequence-parallel "
        "or --moe-pad-expert-input-to-capacity (capacity is counted over the whole sequence of the CP group)",
    )
    if p.cp_comm_type == "a2a":
        tp = p.tensor_model_parallel_size
        heads, groups = m.num_attention_heads // tp, m.num_kv_heads // tp
        _check(
            heads % cp == 0 and groups % cp == 0,
            f"--cp-comm-type a2a needs the attention heads ({heads}) and KV groups ({groups}) per "
            f"tensor-parallel rank divisible by --context-parallel-size {cp}",
        )


def _validate_optimizer(p: ParallelConfig, t: TrainingConfig) -> None:
    """--optimizer and its hyper-parameters; what the layer-wise optimizers do not support."""
    if t.optimizer == "lars":
        _check(t.lars_trust_coefficient > 0, f"--lars-trust-coefficient must be > 0, got {t.lars_trust_coefficient}")
    if t.optimizer == "muon":
        _validate_muon(p, t)
    if t.optimizer == "lion":
        for flag, beta in (("--lion-beta1", t.lion_beta1), ("--lion-beta2", t.lion_beta2)):
            _check(0.0 <= beta < 1.0, f"{flag} must be in [0, 1), got {beta}")


def _validate_muon(p: ParallelConfig, t: TrainingConfig) -> None:
    """Muon's flags (with the distributed optimizer the matrices are assembled: supported)."""
    _check(
        t.muon_tp_mode != "distributed",
        "--muon-tp-mode distributed is not built; use duplicated (gathers each matrix: equals one process) "
        "or blockwise (orthogonalizes each TP shard)",
    )
    _check(
        t.muon_fp32_matmul_prec != "low",
        "--muon-fp32-matmul-prec low is not supported: torch has no 'low' float32 matmul precision (Megatron-LM "
        "passes it to torch.set_float32_matmul_precision, which ignores it with a warning); use medium "
        "(Megatron-LM's default), high or highest (IEEE fp32)",
    )
    _check(t.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1, got {t.muon_num_ns_steps}")
    from megalm.optimizer.muon import MuonError, ns_coefficients  # lazy: the config needs no optimizer imports

    try:
        ns_coefficients(t.muon_coefficient_type, t.muon_num_ns_steps)
    except MuonError as e:
        raise ConfigError(str(e)) from None
    _check(0.0 <= t.muon_momentum < 1.0, f"--muon-momentum must be in [0, 1), got {t.muon_momentum}")


def _validate_precision(m: ModelConfig, p: ParallelConfig, t: TrainingConfig) -> None:
    """bf16 / fp16 / fp8, and the attention cores each precision allows."""
    _check(not (t.bf16 and t.fp16), "--bf16 and --fp16 are mutually exclusive")
    _validate_fp8(m, p, t)
    if m.use_flash_attn:
        _check(
            m.attention_backend in ("auto", "flash"),
            f"--use-flash-attn contradicts --attention-backend {m.attention_backend}: give one of them",
        )
        m.attention_backend = "flash"
    _check(
        m.attention_backend != "flash" or t.bf16 or t.fp16,
        "--attention-backend flash needs --bf16 or --fp16 (flash-attn has no fp32 kernels)",
    )
    keyed = m.position_keyed_attention_dropout or p.context_parallel_size > 1
    _check(
        m.attention_backend != "blocked" or m.attention_dropout == 0 or keyed,
        f"--attention-backend blocked has no attention dropout: set --attention-dropout 0 "
        f"(got {m.attention_dropout}), --position-keyed-attention-dropout or use another backend",
    )
    _check(
        not m.position_keyed_attention_dropout
        or (m.attention_backend != "flash" and not m.use_flash_attn and m.transformer_impl == "local"),
        "--position-keyed-attention-dropout needs megalm's attention core: not with --attention-backend flash / "
        "--use-flash-attn or --transformer-impl transformer_engine",
    )
    _check(t.loss_scale is None or t.fp16, "--loss-scale needs --fp16")
    _check(not p.grad_reduce_in_bf16 or t.bf16, "--grad-reduce-in-bf16 needs --bf16")
    _check(
        not (p.local_sgd_interval and (t.fp16 or t.calculate_per_token_loss)),
        "--local-sgd-interval is not supported with --fp16 (each replica's loss scaler would skip steps on its "
        "own) or --calculate-per-token-loss (it divides by the tokens of all data-parallel ranks)",
    )
    _check(t.loss_scale_window >= 1 and t.hysteresis >= 1, "--loss-scale-window and --hysteresis must be >= 1")
    _validate_numerics_checks(t)


def _validate_numerics_checks(t: TrainingConfig) -> None:
    """--max-overflows-at-min-loss-scale and --check-for-spiky-loss's options."""
    _check(
        t.max_overflows_at_min_loss_scale >= 0,
        f"--max-overflows-at-min-loss-scale must be >= 0 (0 never stops), got {t.max_overflows_at_min_loss_scale}",
    )
    _check(t.spiky_loss_factor > 1.0, f"--spiky-loss-factor must be > 1, got {t.spiky_loss_factor}")
    _check(t.spiky_loss_window >= 1, f"--spiky-loss-window must be >= 1, got {t.spiky_loss_window}")
    _check(
        t.spiky_loss_action != "rollback",
        "--spiky-loss-action rollback (reload the last checkpoint and skip the batch) is not built in megalm; "
        "use warn or stop",
    )


def step_schedule(t: TrainingConfig, seq_length: int) -> Optional[List[Tuple[int, int]]]:
    """``--step-batch-size-schedule`` as (threshold in samples, global batch) pairs, or None."""
    if t.step_batch_size_schedule is None:
        return None
    try:
        return parse_step_batch_size_schedule(t.step_batch_size_schedule, seq_length)
    except ScheduleError as e:
        raise ConfigError(f"--step-batch-size-schedule: {e}") from None


def _validate_step_schedule(m: ModelConfig, t: TrainingConfig) -> None:
    """The schedule parses, excludes --rampup-batch-size and --global-batch-size, and sets the global
    batch size to its largest batch (what the data and learning-rate schedule are sized from)."""
    schedule = step_schedule(t, m.seq_length)
    if schedule is None:
        return
    largest = max(b for _, b in schedule)
    _check(t.rampup_batch_size is None, "give only one of --step-batch-size-schedule and --rampup-batch-size")
    _check(
        t.global_batch_size in (None, largest),
        f"--step-batch-size-schedule sets the global batch size (its largest batch, {largest}); "
        f"do not give --global-batch-size {t.global_batch_size}",
    )
    t.global_batch_size = largest
    batches = [b for _, b in schedule]
    if len(set(batches)) > 1 and t.lr_batch_scaling == "none":
        logger.warning(
            "--step-batch-size-schedule changes the global batch (%s) but not the learning rate --lr %g; "
            "--lr-batch-scaling linear would multiply it by batch / %d, sqrt by sqrt(batch / %d)",
            " -> ".join(str(b) for b in batches),
            t.lr,
            largest,
            largest,
        )


def _validate_lr_batch_scaling(t: TrainingConfig) -> None:
    """--lr-batch-scaling needs a batch that changes."""
    _check(
        t.lr_batch_scaling == "none" or t.rampup_batch_size is not None or t.step_batch_size_schedule is not None,
        f"--lr-batch-scaling {t.lr_batch_scaling} needs --rampup-batch-size or --step-batch-size-schedule "
        "(with a constant batch there is nothing to scale: set --lr itself)",
    )


def _validate_world(p: ParallelConfig, t: TrainingConfig, world_size: int, vpp: Optional[int], seq_length: int) -> None:
    """The layout against the world size; sets the data-parallel size and the global batch size."""
    from megalm.parallel_layout import validate_layout

    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    try:
        p.data_parallel_size = validate_layout(
            world_size,
            tp,
            pp,
            p.context_parallel_size,
            p.expert_model_parallel_size,
            vpp,
            p.expert_tensor_parallel_size or 1,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    p.world_size = world_size
    dp = p.data_parallel_size
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    _check(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}")
    for _, batch in step_schedule(t, seq_length) or []:
        _check(
            batch % (t.micro_batch_size * dp) == 0,
            f"--step-batch-size-schedule batch {batch} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp}",
        )
        _check(
            vpp is None or vpp == 1 or batch // (t.micro_batch_size * dp) % pp == 0,
            f"interleaved pipeline schedule needs the microbatches of --step-batch-size-schedule batch {batch} "
            f"to be divisible by --pipeline-model-parallel-size {pp}",
        )
    _check(
        t.global_batch_size % (t.micro_batch_size * dp) == 0,
        f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
        f"{t.micro_batch_size} x data-parallel size {dp}",
    )
    if vpp is not None and vpp > 1:
        n_micro = t.global_batch_size // (t.micro_batch_size * dp)
        _check(
            n_micro % pp == 0,
            f"interleaved pipeline schedule needs the number of microbatches ({n_micro}) "
            f"to be divisible by --pipeline-model-parallel-size {pp}",
        )
    if t.rampup_batch_size is not None:
        start, incr, _ = t.rampup_batch_size
        gb = t.global_batch_size
        _check(
            0 < start <= gb and incr > 0 and (gb - start) % incr == 0,
            f"--rampup-batch-size start {start} and increment {incr} must step from 0 < start <= "
            f"--global-batch-size {gb} to it in whole increments",
        )
        _check(
            start % (t.micro_batch_size * dp) == 0 and incr % (t.micro_batch_size * dp) == 0,
            f"--rampup-batch-size start {start} and increment {incr} must be multiples of "
            f"micro batch x DP = {t.micro_batch_size * dp}",
        )


def _validate_optimizer_cpu_offload(t: TrainingConfig) -> None:
    """--optimizer-cpu-offload, --optimizer-offload-fraction and --overlap-cpu-optimizer-d2h-h2d."""
    _check(
        not t.overlap_cpu_optimizer_d2h_h2d or t.optimizer_cpu_offload,
        "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload",
    )
    f = t.optimizer_offload_fraction
    _check(0.0 < f <= 1.0, f"--optimizer-offload-fraction must be in (0, 1], got {f}")


def _validate_training_length(t: TrainingConfig) -> None:
    """--train-iters or --train-samples (one of them).  A --rampup-batch-size / --step-batch-size-schedule
    with --train-iters is followed by consumed samples for that many iterations, as in Megatron-LM."""
    _check(
        not (t.train_iters is not None and t.train_samples is not None),
        "give only one of --train-iters and --train-samples",
    )


def _validate_weight_decay_schedule(t: TrainingConfig) -> None:
    """As Megatron: constant takes --weight-decay and neither start nor end; linear/cosine need both
    (and then set the starting --weight-decay)."""
    if t.weight_decay_incr_style == "constant":
        _check(
            t.start_weight_decay is None and t.end_weight_decay is None,
            "--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or cosine",
        )
        return
    _check(
        t.start_weight_decay is not None and t.end_weight_decay is not None,
        f"--weight-decay-incr-style {t.weight_decay_incr_style} needs --start-weight-decay and --end-weight-decay",
    )
    _check(t.start_weight_decay >= 0 and t.end_weight_decay >= 0, "weight decay must be >= 0")
    t.weight_decay = t.start_weight_decay


def _validate_lr_schedule(t: TrainingConfig) -> None:
    """The learning-rate schedule's flags; with the global batch size known, also its lengths in
    samples (:func:`lr_schedule_samples`, what the scheduler is built from)."""
    _validate_weight_decay_schedule(t)
    if t.decoupled_lr is not None:
        _check(t.decoupled_lr > 0, "--decoupled-lr must be positive")
        _check(
            t.decoupled_min_lr is None or 0 <= t.decoupled_min_lr <= t.decoupled_lr,
            "--decoupled-min-lr must be in [0, --decoupled-lr]",
        )
        _check(t.min_lr <= t.decoupled_lr, "--min-lr is larger than --decoupled-lr: give --decoupled-min-lr")
    else:
        _check(t.decoupled_min_lr is None, "--decoupled-min-lr needs --decoupled-lr")
    _check(t.lr_decay_style in DECAY_STYLES, f"--lr-decay-style {t.lr_decay_style!r} is not one of {DECAY_STYLES}")
    _check(t.min_lr <= t.lr, f"--min-lr {t.min_lr} is larger than --lr {t.lr}")
    _check(t.min_lr >= 0.0, f"--min-lr must be >= 0, got {t.min_lr}")
    _check(t.lr_warmup_init <= t.lr, f"--lr-warmup-init {t.lr_warmup_init} is larger than --lr {t.lr}")
    _check(
        t.lr_warmup_fraction is None or (t.lr_warmup_iters == 0 and t.lr_warmup_samples is None),
        "give only one of --lr-warmup-iters, --lr-warmup-samples and --lr-warmup-fraction",
    )
    _check(
        t.lr_warmup_fraction is None or 0.0 <= t.lr_warmup_fraction < 1.0,
        f"--lr-warmup-fraction {t.lr_warmup_fraction} must be in [0, 1)",
    )
    if t.train_iters is not None and t.lr_decay_style != "constant" and t.lr_warmup_fraction is None:
        decay = t.lr_decay_iters or t.train_iters
        _check(
            t.lr_warmup_iters < decay,
            f"--lr-warmup-iters {t.lr_warmup_iters} must be shorter than the decay "
            f"({decay} iterations: --lr-decay-iters or --train-iters)",
        )
    _check(
        not (t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler),
        "give only one of --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler",
    )
    for name, value in (
        ("lr_decay_samples", t.lr_decay_samples),
        ("lr_warmup_samples", t.lr_warmup_samples),
        ("lr_wsd_decay_samples", t.lr_wsd_decay_samples),
    ):
        _check(
            value is None or t.train_samples is not None,
            f"--{name.replace('_', '-')} needs --train-samples (with --train-iters use the *-iters flags)",
        )
    if t.lr_decay_style == "WSD":
        _check(
            t.lr_wsd_decay_style in WSD_DECAY_STYLES,
            f"--lr-wsd-decay-style {t.lr_wsd_decay_style!r} is not one of {WSD_DECAY_STYLES}",
        )
        _check(
            t.lr_wsd_decay_iters or t.lr_wsd_decay_samples,
            "--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)",
        )
    if t.global_batch_size is None or (t.train_iters is None and t.train_samples is None):
        return
    warmup, decay, wsd = lr_schedule_samples(t)
    _check(decay > 0, f"the learning-rate decay must be positive, got {decay} samples")
    _check(
        t.lr_decay_style == "constant" or warmup < decay,
        f"lr warm-up ({warmup} samples) must be shorter than the decay ({decay} samples): check "
        f"--lr-warmup-* and --lr-decay-*",
    )
    _check(
        t.lr_decay_style != "WSD" or (wsd and 0 < wsd <= decay),
        f"--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) in (0, decay]; got {wsd} of {decay} samples",
    )


def lr_schedule_samples(t: TrainingConfig) -> Tuple[float, float, Optional[float]]:
    """``(warm-up, decay, WSD decay)`` lengths of the learning-rate schedule in samples, converted
    from iterations as Megatron does (x ``--global-batch-size``); ``--lr-warmup-fraction`` is a
    fraction of the decay.  Needs ``--train-iters`` or ``--train-samples`` and the global batch size."""
    gbs = t.global_batch_size
    if t.train_iters is not None:
        decay = (t.lr_decay_iters or t.train_iters) * gbs
        warmup = t.lr_warmup_iters * gbs
        wsd = t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters else None
    else:
        decay = t.lr_decay_samples or (t.lr_decay_iters * gbs if t.lr_decay_iters else t.train_samples)
        warmup = t.lr_warmup_samples or t.lr_warmup_iters * gbs
        wsd = t.lr_wsd_decay_samples or (t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters else None)
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    return warmup, decay, wsd


def _validate_data(d: DataConfig, m: ModelConfig, p: ParallelConfig) -> None:
    """Data sources, split, tokenizer flags; sets the padded vocabulary size when the vocabulary is known."""
    sources = [d.data_path, d.train_data_path, d.valid_data_path, d.test_data_path]
    _check(not (d.mock_data and any(sources)), "--mock-data cannot be combined with data paths")
    _check(not (d.data_path and any(sources[1:])), "give either --data-path or --train/valid/test-data-path, not both")
    if d.split:
        try:
            parse_split(d.split)
        except DataError as e:
            raise ConfigError(str(e)) from None
    _check(d.mid_level_dataset_surplus >= 0, "--mid-level-dataset-surplus must be >= 0")
    if d.reset_attention_mask:
        _validate_reset_attention_mask(m, p)
    if d.tokenizer_type is None and (d.vocab_file or d.merge_file):
        d.tokenizer_type = "GPT2BPETokenizer"  # Megatron's pretrain_gpt default for --vocab-file / --merge-file
    if d.tokenizer_type is not None:
        missing = missing_tokenizer_flags(
            d.tokenizer_type,
            tokenizer_model=d.tokenizer_model,
            vocab_size=m.vocab_size,
            vocab_file=d.vocab_file,
            merge_file=d.merge_file,
        )
        _check(not missing, f"--tokenizer-type {d.tokenizer_type} needs {' and '.join(missing)}")
    if m.vocab_size is not None:
        m.padded_vocab_size = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tensor_model_parallel_size)


def _validate_reset_attention_mask(m: ModelConfig, p: ParallelConfig) -> None:
    """--reset-attention-mask runs megalm's SDPA, blocked or unfused cores with the document mask."""
    for refused, what in (
        (p.context_parallel_size > 1, "--context-parallel-size > 1 (the CP cores are causal only)"),
        (m.transformer_impl != "local", "--transformer-impl transformer_engine (TE's core is given no mask here)"),
        (m.attention_backend == "flash" or m.use_flash_attn, "--attention-backend flash (flash-attn takes no mask)"),
        (m.position_keyed_attention_dropout, "--position-keyed-attention-dropout (its core is causal only)"),
    ):
        _check(not refused, f"--reset-attention-mask is not supported with {what}")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _check(c.save_interval is None or c.save_interval > 0, "--save-interval must be positive")
    _check(not c.async_save or c.save is not None, "--async-save needs --save")
    if c.non_persistent_save_interval is not None:
        _check(c.non_persistent_save_interval > 0, "--non-persistent-save-interval must be positive")
        _check(
            c.non_persistent_ckpt_type in (None, "global"),
            f"--non-persistent-ckpt-type {c.non_persistent_ckpt_type} is not built (global is)",
        )
        _check(
            c.save is not None or c.non_persistent_global_ckpt_dir is not None,
            "--non-persistent-save-interval needs --save or --non-persistent-global-ckpt-dir",
        )
    _check(
        not c.ckpt_fallback_to_verified or (c.load is not None and c.ckpt_step is None),
        "--ckpt-fallback-to-verified needs --load and no --ckpt-step (an explicit step is loaded or refused)",
    )


def _validate_hang_watchdog(t: TrainingConfig, p: ParallelConfig) -> None:
    _check(p.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive")
    seconds, timeout = t.hang_watchdog_seconds, p.distributed_timeout_minutes * 60
    _check(seconds >= 0, f"--hang-watchdog-seconds must be >= 0 (0: off), got {seconds:g}")
    _check(
        seconds < timeout,
        f"--hang-watchdog-seconds {seconds:g} must be below --distributed-timeout-minutes "
        f"{p.distributed_timeout_minutes:g} ({timeout:g} s): the collective timeout would end the job first",
    )


def _validate_logging(lg: LoggingConfig, world_size: Optional[int]) -> None:
    _check(lg.log_interval > 0, "--log-interval must be positive")
    _check(
        lg.tensorboard_log_interval is None or lg.tensorboard_log_interval > 0,
        "--tensorboard-log-interval must be positive",
    )
    _check(lg.straggler_minmax_count > 0, f"--straggler-minmax-count must be positive, got {lg.straggler_minmax_count}")
    port = lg.straggler_ctrlr_port
    _check(0 <= port <= 65535, f"--straggler-ctrlr-port must be a TCP port (0-65535), got {port}")
    _validate_profiling(lg, world_size)


def _validate_profiling(lg, world_size: Optional[int]) -> None:
    if lg.use_pytorch_profiler:
        _check(lg.profile, "--use-pytorch-profiler needs --profile")
        _check(lg.tensorboard_dir is not None, "--use-pytorch-profiler writes its trace to --tensorboard-dir: give one")
    if not lg.profile:
        return
    _check(
        0 <= lg.profile_step_start < lg.profile_step_end,
        f"--profile-step-start {lg.profile_step_start} must be >= 0 and before --profile-step-end "
        f"{lg.profile_step_end}",
    )
    bad = [r for r in lg.profile_ranks if r < 0 or (world_size is not None and r >= world_size)]
    _check(
        not bad and lg.profile_ranks,
        f"--profile-ranks {bad or lg.profile_ranks} must be ranks of the world (size {world_size})",
    )
    _check(
        lg.use_pytorch_profiler or use_cuda(),
        "--profile without --use-pytorch-profiler drives nsys through CUDA and this machine has no GPU: "
        "add --use-pytorch-profiler (and --tensorboard-dir)",
    )


def set_vocab_size(cfg: MegalmConfig, vocab_size: int) -> None:
    """Record the tokenizer's vocabulary size and the padded size used by the embedding."""
    cfg.model.vocab_size = vocab_size
    cfg.model.padded_vocab_size = pad_vocab_size(
        vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size
    )
