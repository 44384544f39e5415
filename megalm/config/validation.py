"""Validation: :func:`validate_config` is the only place where flag combinations are checked
and derived values (FFN width, padded vocabulary, data-parallel size, ...) are set; it runs
before any process group or model exists.  Errors are :class:`ConfigError` naming the flags."""

from __future__ import annotations

import math
from typing import Optional, Tuple

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
from megalm.log import get_logger
from megalm.tokenizers.build import missing_tokenizer_flags

logger = get_logger(__name__)

# Megatron-LM flags that have no meaning in megalm: accepted so Megatron scripts run unchanged,
# with a warning naming what megalm does instead.
MEGATRON_NO_OPS = {
    "--apply-query-key-layer-scaling": "Megatron's fp16 overflow guard inside its fused softmax; megalm's "
    "attention scales q k^T by 1/sqrt(head dim) only",
    "--log-throughput": "megalm always logs tokens per second, TFLOP/s per rank and MFU",
    "--log-validation-ppl-to-tensorboard": "megalm always logs validation perplexity (lm loss <split> ppl)",
}

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine")


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


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
    _check(
        m.moe_router_score_function == "softmax" or not m.moe_router_pre_softmax,
        "--moe-router-pre-softmax needs --moe-router-score-function softmax",
    )
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
    ):
        _check(size == 1, f"--data-parallel-sharding-strategy {s} with {flag} {size} is not built yet")
    _check(
        not p.hierarchical_grad_reduce,
        f"--data-parallel-sharding-strategy {s} with --hierarchical-grad-reduce is not built yet",
    )
    if s != "optim_grads_params":
        return
    _check(
        m.recompute_granularity is None,
        f"--data-parallel-sharding-strategy optim_grads_params with --recompute-granularity "
        f"{m.recompute_granularity} is not built yet (the recomputed forward would free weights its backward needs)",
    )
    _check(
        m.num_experts is None,
        "--data-parallel-sharding-strategy optim_grads_params with --num-experts is not built yet (ranks whose "
        "experts get different tokens could gather in different orders)",
    )
    _check(
        not p.overlap_param_gather,
        "--data-parallel-sharding-strategy optim_grads_params gathers each bucket's parameters just before "
        "use (no prefetch); --overlap-param-gather is not built for it",
    )


def _validate_data_parallel(p: ParallelConfig) -> None:
    """The data-parallel wrapper's flags (megalm.distributed.data_parallel reads them unchecked)."""
    _check(
        not p.overlap_param_gather or p.use_distributed_optimizer,
        "--overlap-param-gather needs --use-distributed-optimizer (it overlaps the optimizer's parameter all-gather)",
    )
    _check(
        p.ddp_bucket_size is None or p.ddp_bucket_size > 0,
        f"--ddp-bucket-size must be positive, got {p.ddp_bucket_size}",
    )


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
    _validate_model(m, p)
    vpp = _validate_pipeline(m, p)
    _validate_parallel(m, p)
    _validate_moe(m, p)
    _validate_precision(m, p, t)
    if world_size is not None:
        _validate_world(p, t, world_size, vpp)
    _validate_training_length(t)
    _validate_lr_schedule(t)
    _validate_data(cfg.data, m, p)
    _validate_checkpoint(cfg.checkpoint)
    _validate_logging(cfg.logging, world_size)
    _warn_megatron_no_ops(cfg)
    return cfg


def _warn_megatron_no_ops(cfg: MegalmConfig) -> None:
    given = {
        "--apply-query-key-layer-scaling": cfg.model.apply_query_key_layer_scaling,
        "--log-throughput": cfg.logging.log_throughput,
        "--log-validation-ppl-to-tensorboard": cfg.logging.log_validation_ppl_to_tensorboard,
    }
    for flag, value in given.items():
        if value:
            logger.warning("%s has no effect in megalm: %s", flag, MEGATRON_NO_OPS[flag])


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
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = int((4 * m.hidden_size * 2 / 3) / 64) * 64 if m.swiglu else 4 * m.hidden_size
        m.ffn_hidden_size = max(m.ffn_hidden_size, 64 if m.swiglu else m.ffn_hidden_size)
    _check(
        m.ffn_hidden_size % tp == 0,
        f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}",
    )
    if m.position_embedding_type == "rope":
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


def _validate_heads(m: ModelConfig, tp: int) -> None:
    """Attention heads and query groups split over the tensor-parallel ranks."""
    if m.kv_channels is None:
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


def _validate_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    """Context parallelism, the data-parallel wrapper's flags and sequence parallelism."""
    tp = p.tensor_model_parallel_size
    _check(p.context_parallel_size == 1, "--context-parallel-size > 1 is not supported yet")
    _validate_sharding_strategy(m, p)
    _validate_data_parallel(p)
    if p.sequence_parallel and tp == 1:
        p.sequence_parallel = False  # as Megatron: a no-op without tensor parallelism
    if p.sequence_parallel:
        _check(
            m.seq_length % tp == 0,
            f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} (sequence parallel)",
        )


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
    _check(
        m.attention_backend != "blocked" or m.attention_dropout == 0,
        f"--attention-backend blocked has no attention dropout: set --attention-dropout 0 "
        f"(got {m.attention_dropout}) or use another backend",
    )
    _check(t.loss_scale is None or t.fp16, "--loss-scale needs --fp16")
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


def _validate_world(p: ParallelConfig, t: TrainingConfig, world_size: int, vpp: Optional[int]) -> None:
    """The layout against the world size; sets the data-parallel size and the global batch size."""
    from megalm.parallel_layout import validate_layout

    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    try:
        p.data_parallel_size = validate_layout(
            world_size, tp, pp, p.context_parallel_size, p.expert_model_parallel_size, vpp
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    p.world_size = world_size
    dp = p.data_parallel_size
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    _check(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}")
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
        _check(
            start % (t.micro_batch_size * dp) == 0 and incr % (t.micro_batch_size * dp) == 0,
            f"--rampup-batch-size start {start} and increment {incr} must be multiples of "
            f"micro batch x DP = {t.micro_batch_size * dp}",
        )


def _validate_training_length(t: TrainingConfig) -> None:
    f = t.optimizer_offload_fraction
    _check(0.0 < f <= 1.0, f"--optimizer-offload-fraction must be in (0, 1], got {f}")
    _check(
        not (t.train_iters is not None and t.train_samples is not None),
        "give only one of --train-iters and --train-samples",
    )
    _check(t.rampup_batch_size is None or t.train_samples is not None, "--rampup-batch-size needs --train-samples")


def _validate_lr_schedule(t: TrainingConfig) -> None:
    """The learning-rate schedule's flags; with the global batch size known, also its lengths in
    samples (:func:`lr_schedule_samples`, what the scheduler is built from)."""
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
        parts = [s for s in d.split.replace("/", ",").split(",") if s.strip()]
        try:
            vals = [float(s) for s in parts]
        except ValueError:
            raise ConfigError(f"--split {d.split!r} must be comma-separated numbers, e.g. 969,30,1") from None
        _check(
            len(vals) <= 3 and all(v >= 0 for v in vals) and sum(vals) > 0,
            f"--split {d.split!r} needs up to three non-negative proportions with a positive sum",
        )
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


def _validate_checkpoint(c: CheckpointConfig) -> None:
    _check(c.save_interval is None or c.save_interval > 0, "--save-interval must be positive")
    _check(not c.async_save or c.save is not None, "--async-save needs --save")
    _check(
        not c.ckpt_fallback_to_verified or (c.load is not None and c.ckpt_step is None),
        "--ckpt-fallback-to-verified needs --load and no --ckpt-step (an explicit step is loaded or refused)",
    )


def _validate_logging(lg: LoggingConfig, world_size: Optional[int]) -> None:
    _check(lg.log_interval > 0, "--log-interval must be positive")
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


def set_vocab_size(cfg: MegalmConfig, vocab_size: int) -> None:
    """Record the tokenizer's vocabulary size and the padded size used by the embedding."""
    cfg.model.vocab_size = vocab_size
    cfg.model.padded_vocab_size = pad_vocab_size(
        vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size
    )
