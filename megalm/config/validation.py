"""Validation: :func:`validate_config` is the only place where flag combinations are checked
and derived values (FFN width, padded vocabulary, data-parallel size, ...) are set; it runs
before any process group or model exists.  Errors are :class:`ConfigError` naming the flags."""

from __future__ import annotations

import math
from typing import Optional

from megalm.config.sections import ConfigError, MegalmConfig, ModelConfig, ParallelConfig
from megalm.tokenizers.build import missing_tokenizer_flags


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
    _check(tp == 1 or p.sequence_parallel,
           f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel (each tensor-parallel rank "
           f"routes its own slice of the sequence)")
    if m.moe_ffn_hidden_size is None:
        m.moe_ffn_hidden_size = m.ffn_hidden_size
    _check(m.moe_ffn_hidden_size > 0, f"--moe-ffn-hidden-size must be positive, got {m.moe_ffn_hidden_size}")
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        _check(freq >= 1, f"--moe-layer-freq {freq} must be >= 1")
    else:
        _check(isinstance(freq, list) and len(freq) == m.num_layers and all(v in (0, 1) for v in freq),
               f"--moe-layer-freq {freq} must have one 0/1 entry per layer (--num-layers {m.num_layers})")
    _check(m.moe_router_score_function == "softmax" or not m.moe_router_pre_softmax,
           "--moe-router-pre-softmax needs --moe-router-score-function softmax")
    _check(m.moe_aux_loss_coeff >= 0.0, f"--moe-aux-loss-coeff must be >= 0, got {m.moe_aux_loss_coeff}")
    _check(m.moe_z_loss_coeff is None or m.moe_z_loss_coeff >= 0.0,
           f"--moe-z-loss-coeff must be >= 0, got {m.moe_z_loss_coeff}")
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None:
        _check(shared > 0 and shared % tp == 0,
               f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
               f"--tensor-model-parallel-size {tp}")
    cf = m.moe_expert_capacity_factor
    _check(cf is None or cf > 0.0, f"--moe-expert-capacity-factor must be positive, got {cf}")
    _check(cf is not None or not m.moe_pad_expert_input_to_capacity,
           "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")


def _validate_data_parallel(p: ParallelConfig) -> None:
    """The data-parallel wrapper's flags (megalm.distributed.data_parallel reads them unchecked)."""
    _check(not p.overlap_param_gather or p.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer "
           "(it overlaps the optimizer's parameter all-gather)")
    _check(p.ddp_bucket_size is None or p.ddp_bucket_size > 0,
           f"--ddp-bucket-size must be positive, got {p.ddp_bucket_size}")


def _validate_fp8(m: ModelConfig, p: ParallelConfig, t) -> None:
    """``--fp8-*``: Transformer Engine layers, delayed-scaling settings, and the shapes TE's fp8 GEMMs take."""
    if m.fp8_format is None:
        return
    _check(m.transformer_impl == "transformer_engine", f"--fp8-format {m.fp8_format} needs --transformer-impl "
                                                       f"transformer_engine (fp8 runs inside Transformer Engine's layers)")
    _check(m.fp8_margin >= 0 and m.fp8_amax_history_len >= 1,
           f"--fp8-margin must be >= 0 and --fp8-amax-history-len >= 1, got {m.fp8_margin} and {m.fp8_amax_history_len}")
    _check(m.recompute_granularity != "full", "--fp8-format with --recompute-granularity full is not supported "
                                              "(megalm's recompute does not replay TE's fp8 scaling state); use "
                                              "--recompute-granularity selective or no recompute")
    tp, heads, d = p.tensor_model_parallel_size, m.num_attention_heads, m.head_dim
    widths = {"hidden": m.hidden_size, "qkv/tp": (heads + 2 * m.num_kv_heads) * d // tp, "heads*d/tp": heads * d // tp,
              "ffn/tp": m.ffn_hidden_size // tp}  # fc1's [gate; up] width is twice ffn/tp
    bad = {name: width for name, width in widths.items() if width % 16}
    _check(not bad, f"--fp8-format: Transformer Engine's fp8 GEMMs need widths divisible by 16, got {bad}")
    tokens = m.seq_length * t.micro_batch_size // (tp if p.sequence_parallel else 1)
    _check(tokens % 8 == 0, f"--fp8-format: Transformer Engine's fp8 GEMMs need the tokens per rank and micro-batch "
                            f"(--seq-length x --micro-batch-size, / TP under sequence parallelism) divisible by 8, "
                            f"got {tokens}")


def validate_config(cfg: MegalmConfig, world_size: Optional[int] = None) -> MegalmConfig:
    """Check every combination and fill derived values.  Raises :class:`ConfigError`."""
    m, p, t, d = cfg.model, cfg.parallel, cfg.training, cfg.data
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _check(getattr(m, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(m, name)}")
    _check(tp >= 1 and pp >= 1, f"parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})")

    # Heads and hidden sizes.
    if m.kv_channels is None:
        _check(m.hidden_size % m.num_attention_heads == 0,
               f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}")
    _check(m.num_attention_heads % tp == 0,
           f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if m.group_query_attention:
        _check(m.num_query_groups is not None and m.num_query_groups > 0,
               "--group-query-attention needs --num-query-groups")
        _check(m.num_attention_heads % m.num_query_groups == 0,
               f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups {m.num_query_groups}")
        _check(m.num_query_groups % tp == 0,
               f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}")
    else:
        m.num_query_groups = None
    if m.ffn_hidden_size is None:
        m.ffn_hidden_size = int((4 * m.hidden_size * 2 / 3) / 64) * 64 if m.swiglu else 4 * m.hidden_size
        m.ffn_hidden_size = max(m.ffn_hidden_size, 64 if m.swiglu else m.ffn_hidden_size)
    _check(m.ffn_hidden_size % tp == 0,
           f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    if m.position_embedding_type == "rope":
        rot = int(m.head_dim * m.rotary_percent)
        _check(rot % 2 == 0 and rot > 0, f"rotary dimension {rot} (head dim {m.head_dim} x --rotary-percent "
                                         f"{m.rotary_percent}) must be a positive even number")
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if m.position_embedding_type == "learned_absolute":
        _check(m.seq_length <= m.max_position_embeddings,
               f"--seq-length {m.seq_length} is longer than --max-position-embeddings {m.max_position_embeddings} "
               f"with learned absolute positions")
    for name in ("hidden_dropout", "attention_dropout"):
        _check(0.0 <= getattr(m, name) < 1.0, f"--{name.replace('_', '-')} must be in [0, 1)")

    # Recompute.
    if m.recompute_granularity == "full":
        _check(m.recompute_method is not None, "--recompute-granularity full needs --recompute-method {uniform,block}")
        _check(m.recompute_num_layers is not None and m.recompute_num_layers >= 1,
               "--recompute-granularity full needs --recompute-num-layers >= 1")
    elif m.recompute_method is not None:
        _check(False, f"--recompute-method {m.recompute_method} needs --recompute-granularity full")

    # Pipeline split.
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        _check(pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        middle_layers = m.num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        _check(middle_layers >= 0 and (middle_stages == 0 and middle_layers == 0 or
                                       middle_stages > 0 and middle_layers % middle_stages == 0),
               f"--num-layers {m.num_layers} minus first ({first}) and last ({last}) stage layers "
               f"cannot be split evenly over the other {middle_stages} pipeline stages")
    else:
        _check(m.num_layers % pp == 0,
               f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    vpp = None
    if p.num_layers_per_virtual_pipeline_stage is not None or p.num_virtual_stages_per_pipeline_rank is not None:
        _check(p.num_layers_per_virtual_pipeline_stage is None or p.num_virtual_stages_per_pipeline_rank is None,
               "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank")
        _check(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
        _check(first is None and last is None, "uneven first/last stages are not supported with virtual stages")
        if p.num_layers_per_virtual_pipeline_stage is not None:
            per_rank = m.num_layers // pp
            _check(per_rank % p.num_layers_per_virtual_pipeline_stage == 0,
                   f"layers per pipeline rank ({per_rank}) is not divisible by "
                   f"--num-layers-per-virtual-pipeline-stage {p.num_layers_per_virtual_pipeline_stage}")
            vpp = per_rank // p.num_layers_per_virtual_pipeline_stage
        else:
            vpp = p.num_virtual_stages_per_pipeline_rank
            _check((m.num_layers // pp) % vpp == 0,
                   f"layers per pipeline rank ({m.num_layers // pp}) is not divisible by "
                   f"--num-virtual-stages-per-pipeline-rank {vpp}")
    p.virtual_pipeline_model_parallel_size = vpp
    _check(p.context_parallel_size == 1, "--context-parallel-size > 1 is not supported yet")
    _validate_data_parallel(p)
    if p.sequence_parallel and tp == 1:
        p.sequence_parallel = False  # as Megatron: a no-op without tensor parallelism
    if p.sequence_parallel:
        _check(m.seq_length % tp == 0,
               f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} (sequence parallel)")
    _validate_moe(m, p)

    # Precision.
    _check(not (t.bf16 and t.fp16), "--bf16 and --fp16 are mutually exclusive")
    _validate_fp8(m, p, t)
    if m.use_flash_attn:
        _check(m.attention_backend in ("auto", "flash"),
               f"--use-flash-attn contradicts --attention-backend {m.attention_backend}: give one of them")
        m.attention_backend = "flash"
    _check(m.attention_backend != "flash" or t.bf16 or t.fp16,
           "--attention-backend flash needs --bf16 or --fp16 (flash-attn has no fp32 kernels)")
    _check(m.attention_backend != "blocked" or m.attention_dropout == 0,
           f"--attention-backend blocked has no attention dropout: set --attention-dropout 0 "
           f"(got {m.attention_dropout}) or use another backend")
    _check(t.loss_scale is None or t.fp16, "--loss-scale needs --fp16")

    # World size dependent checks.
    if world_size is not None:
        from megalm.parallel_state import validate_layout

        try:
            p.data_parallel_size = validate_layout(world_size, tp, pp, p.context_parallel_size,
                                                   p.expert_model_parallel_size, vpp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        p.world_size = world_size
        dp = p.data_parallel_size
        if t.global_batch_size is None:
            t.global_batch_size = t.micro_batch_size * dp
        _check(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}")
        _check(t.global_batch_size % (t.micro_batch_size * dp) == 0,
               f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
               f"{t.micro_batch_size} x data-parallel size {dp}")
        if vpp is not None and vpp > 1:
            n_micro = t.global_batch_size // (t.micro_batch_size * dp)
            _check(n_micro % pp == 0,
                   f"interleaved pipeline schedule needs the number of microbatches ({n_micro}) "
                   f"to be divisible by --pipeline-model-parallel-size {pp}")
        if t.rampup_batch_size is not None:
            start, incr, _ = t.rampup_batch_size
            _check(start % (t.micro_batch_size * dp) == 0 and incr % (t.micro_batch_size * dp) == 0,
                   f"--rampup-batch-size start {start} and increment {incr} must be multiples of "
                   f"micro batch x DP = {t.micro_batch_size * dp}")

    # Training length.
    _check(not (t.train_iters is not None and t.train_samples is not None),
           "give only one of --train-iters and --train-samples")
    _check(t.rampup_batch_size is None or t.train_samples is not None,
           "--rampup-batch-size needs --train-samples")
    _check(t.lr_warmup_fraction is None or (t.lr_warmup_iters == 0 and t.lr_warmup_samples is None),
           "give only one of --lr-warmup-iters, --lr-warmup-samples and --lr-warmup-fraction")
    if t.train_iters is not None and t.lr_decay_style != "constant" and t.lr_warmup_fraction is None:
        decay = t.lr_decay_iters or t.train_iters
        _check(t.lr_warmup_iters < decay, f"--lr-warmup-iters {t.lr_warmup_iters} must be shorter than the decay "
                                          f"({decay} iterations: --lr-decay-iters or --train-iters)")
    _check(not (t.override_opt_param_scheduler and t.use_checkpoint_opt_param_scheduler),
           "give only one of --override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler")
    for name in ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"):
        _check(getattr(t, name) is None or t.train_samples is not None,
               f"--{name.replace('_', '-')} needs --train-samples (with --train-iters use the *-iters flags)")
    _check(t.min_lr <= t.lr, f"--min-lr {t.min_lr} is larger than --lr {t.lr}")
    _check(t.loss_scale_window >= 1 and t.hysteresis >= 1, "--loss-scale-window and --hysteresis must be >= 1")

    # Data.
    sources = [d.data_path, d.train_data_path, d.valid_data_path, d.test_data_path]
    _check(not (d.mock_data and any(sources)), "--mock-data cannot be combined with data paths")
    _check(not (d.data_path and any(sources[1:])),
           "give either --data-path or --train/valid/test-data-path, not both")
    if d.split:
        parts = [s for s in d.split.replace("/", ",").split(",") if s.strip()]
        try:
            vals = [float(s) for s in parts]
        except ValueError:
            raise ConfigError(f"--split {d.split!r} must be comma-separated numbers, e.g. 969,30,1") from None
        _check(len(vals) <= 3 and all(v >= 0 for v in vals) and sum(vals) > 0,
               f"--split {d.split!r} needs up to three non-negative proportions with a positive sum")
    if d.tokenizer_type is not None:
        missing = missing_tokenizer_flags(d.tokenizer_type, tokenizer_model=d.tokenizer_model, vocab_size=m.vocab_size,
                                          vocab_file=d.vocab_file, merge_file=d.merge_file)
        _check(not missing, f"--tokenizer-type {d.tokenizer_type} needs {' and '.join(missing)}")
    if m.vocab_size is not None:
        m.padded_vocab_size = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)

    # Checkpoints and logging.
    _check(cfg.checkpoint.save_interval is None or cfg.checkpoint.save_interval > 0, "--save-interval must be positive")
    _check(not cfg.checkpoint.async_save or cfg.checkpoint.save is not None, "--async-save needs --save")
    _check(cfg.logging.log_interval > 0, "--log-interval must be positive")
    _validate_profiling(cfg.logging, world_size)
    return cfg


def _validate_profiling(lg, world_size: Optional[int]) -> None:
    if lg.use_pytorch_profiler:
        _check(lg.profile, "--use-pytorch-profiler needs --profile")
        _check(lg.tensorboard_dir is not None, "--use-pytorch-profiler writes its trace to --tensorboard-dir: give one")
    if not lg.profile:
        return
    _check(0 <= lg.profile_step_start < lg.profile_step_end,
           f"--profile-step-start {lg.profile_step_start} must be >= 0 and before --profile-step-end "
           f"{lg.profile_step_end}")
    bad = [r for r in lg.profile_ranks if r < 0 or (world_size is not None and r >= world_size)]
    _check(not bad and lg.profile_ranks, f"--profile-ranks {bad or lg.profile_ranks} must be ranks of the world "
                                         f"(size {world_size})")


def set_vocab_size(cfg: MegalmConfig, vocab_size: int) -> None:
    """Record the tokenizer's vocabulary size and the padded size used by the embedding."""
    cfg.model.vocab_size = vocab_size
    cfg.model.padded_vocab_size = pad_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by,
                                                 cfg.parallel.tensor_model_parallel_size)
