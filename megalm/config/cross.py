"""Checks across configuration sections, in one place: the model against the parallel layout
(heads, FFN, pipeline stages, context and sequence parallelism, experts), the precision and
attention core against both, the batch against the world size, and the derived values that need
two sections (the data-parallel size, the global batch size, the padded vocabulary).  Each
section's own checks are its ``validate()``; :func:`megalm.config.validate_config` runs them
first, then :func:`validate_cross`."""

from __future__ import annotations

import math
import os
from typing import List, Optional, Tuple

from megalm.config.batch_schedule import ScheduleError, parse_step_batch_size_schedule
from megalm.config.data import missing_tokenizer_flags
from megalm.config.fault_tolerance import validate_fault_tolerance, validate_ft_batch
from megalm.config.fields import ConfigError, check
from megalm.config.fsdp import validate_fsdp_grad_dtypes
from megalm.config.lr_schedule import validate_lr_schedule_lengths
from megalm.log import get_logger

logger = get_logger(__name__)


def pad_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def validate_cross(cfg, world_size: Optional[int]) -> None:
    """Every check that reads two sections; sets the derived values that need them."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    validate_fsdp_grad_dtypes(p, t)  # Megatron-FSDP's gradient dtypes onto the gradient buffers
    _validate_model_split(m, p)
    _validate_mtp(m, p)
    vpp = _validate_pipeline(m, p)
    _validate_context_parallel(m, p)
    _validate_sequence_parallel(m, p)
    _validate_moe_layout(m, p)
    _validate_expert_tensor_parallel(m, p, t)
    _validate_activation_offloading(m, p)
    _validate_precision(m, p, t)
    _validate_instances(m, p, t)
    _validate_step_schedule(m, t)
    validate_fault_tolerance(cfg)  # torchft replica groups: before the global batch gets its default
    if world_size is not None:
        _validate_world(p, t, world_size, vpp, m.seq_length)
        validate_ft_batch(p, t, step_schedule(t, m.seq_length))
    validate_lr_schedule_lengths(t)
    _validate_data(cfg.data, m, p)
    lg = cfg.logging
    if lg.wandb_project and not lg.wandb_save_dir and cfg.checkpoint.save:
        lg.wandb_save_dir = os.path.join(cfg.checkpoint.save, "wandb")  # Megatron's default
    _validate_hang_watchdog(t, p)
    _validate_rebalance(cfg.data, p, t)


def _validate_rebalance(d, p, t) -> None:
    if not t.straggler_rebalance_interval:
        return
    check(
        d.dataloader_type == "single",
        "--straggler-rebalance-interval needs --dataloader-type single (shares are slots of each global batch)",
    )
    check(
        not p.num_layers_per_virtual_pipeline_stage,
        "--straggler-rebalance-interval does not work with the interleaved pipeline schedule (its micro-batch "
        "count must be a multiple of the pipeline size on every replica)",
    )


def _validate_model_split(m, p) -> None:
    """Heads, query groups and the FFN split over the tensor-parallel ranks."""
    tp = p.tensor_model_parallel_size
    check(
        m.num_attention_heads % tp == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}",
    )
    if m.group_query_attention:
        check(
            m.num_query_groups % tp == 0,
            f"--num-query-groups {m.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}",
        )
    check(
        m.ffn_hidden_size % tp == 0,
        f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}",
    )


def _validate_mtp(m, p) -> None:
    """--mtp-num-layers: pipelined only with RoPE (the last stage's embedding copy has no position table)."""
    if m.mtp_num_layers is None:
        return
    check(
        p.pipeline_model_parallel_size == 1 or m.position_embedding_type != "learned_absolute",
        "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs --position-embedding-type rope or none "
        "(the last stage embeds its tokens with a copy of the word embedding only)",
    )


def _validate_pipeline(m, p) -> Optional[int]:
    """The layer split over pipeline stages; sets and returns the virtual pipeline size (or None)."""
    pp = p.pipeline_model_parallel_size
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        check(pp > 1, "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        middle_layers = m.num_layers - (first or 0) - (last or 0)
        middle_stages = pp - (first is not None) - (last is not None)
        check(
            middle_layers >= 0
            and (middle_stages == 0 and middle_layers == 0 or middle_stages > 0 and middle_layers % middle_stages == 0),
            f"--num-layers {m.num_layers} minus first ({first}) and last ({last}) stage layers "
            f"cannot be split evenly over the other {middle_stages} pipeline stages",
        )
    else:
        check(
            m.num_layers % pp == 0,
            f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size {pp}",
        )
    vpp = None
    if p.num_layers_per_virtual_pipeline_stage is not None or p.num_virtual_stages_per_pipeline_rank is not None:
        check(
            p.num_layers_per_virtual_pipeline_stage is None or p.num_virtual_stages_per_pipeline_rank is None,
            "give only one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank",
        )
        check(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
        check(first is None and last is None, "uneven first/last stages are not supported with virtual stages")
        per_rank = m.num_layers // pp
        if p.num_layers_per_virtual_pipeline_stage is not None:
            check(
                per_rank % p.num_layers_per_virtual_pipeline_stage == 0,
                f"layers per pipeline rank ({per_rank}) is not divisible by "
                f"--num-layers-per-virtual-pipeline-stage {p.num_layers_per_virtual_pipeline_stage}",
            )
            vpp = per_rank // p.num_layers_per_virtual_pipeline_stage
        else:
            vpp = p.num_virtual_stages_per_pipeline_rank
            check(
                per_rank % vpp == 0,
                f"layers per pipeline rank ({per_rank}) is not divisible by "
                f"--num-virtual-stages-per-pipeline-rank {vpp}",
            )
    p.virtual_pipeline_model_parallel_size = vpp
    return vpp


def _validate_context_parallel(m, p) -> None:
    """What megalm does not build under --context-parallel-size > 1."""
    cp = p.context_parallel_size
    if cp == 1:
        return
    check(
        m.seq_length % (2 * cp) == 0,
        f"--seq-length {m.seq_length} must be divisible by 2 x --context-parallel-size ({2 * cp}): "
        f"each CP rank holds two of 2 x CP equal chunks",
    )
    check(
        m.transformer_impl == "local",
        "--transformer-impl transformer_engine is not supported with --context-parallel-size > 1 (use local)",
    )
    check(
        m.attention_backend != "flash" and not m.use_flash_attn,
        "--attention-backend flash / --use-flash-attn are not supported with --context-parallel-size > 1 "
        "(the CP cores compute their own blocks; a2a runs SDPA, blocked or unfused)",
    )
    check(
        m.moe_expert_capacity_factor is None
        or not ((p.sequence_parallel and p.tensor_model_parallel_size > 1) or m.moe_pad_expert_input_to_capacity),
        "--moe-expert-capacity-factor with --context-parallel-size > 1 is not supported with --sequence-parallel "
        "or --moe-pad-expert-input-to-capacity (capacity is counted over the whole sequence of the CP group)",
    )
    if p.cp_comm_type == "a2a":
        tp = p.tensor_model_parallel_size
        heads, groups = m.num_attention_heads // tp, m.num_kv_heads // tp
        check(
            heads % cp == 0 and groups % cp == 0,
            f"--cp-comm-type a2a needs the attention heads ({heads}) and KV groups ({groups}) per "
            f"tensor-parallel rank divisible by --context-parallel-size {cp}",
        )


def _validate_sequence_parallel(m, p) -> None:
    if not p.sequence_parallel:
        return
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    per_cp = f" / --context-parallel-size {cp}" if cp > 1 else ""
    check(
        m.seq_length // cp % tp == 0,
        f"--seq-length {m.seq_length}{per_cp} is not divisible by --tensor-model-parallel-size {tp} "
        f"(sequence parallel)",
    )


def _validate_moe_layout(m, p) -> None:
    """The experts over the expert-parallel and tensor-parallel ranks."""
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    if m.num_experts is None:
        check(ep == 1, f"--expert-model-parallel-size {ep} needs --num-experts")
        return
    e = m.num_experts
    check(ep >= 1 and e % ep == 0, f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}")
    check(
        tp == 1 or p.sequence_parallel,
        f"MoE with --tensor-model-parallel-size {tp} needs --sequence-parallel (each tensor-parallel rank "
        f"routes its own slice of the sequence)",
    )
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None:
        check(
            shared > 0 and shared % tp == 0,
            f"--moe-shared-expert-intermediate-size {shared} must be positive and divisible by "
            f"--tensor-model-parallel-size {tp}",
        )


def _validate_expert_tensor_parallel(m, p, t) -> None:
    """``--expert-tensor-parallel-size``: absent means 1 (experts whole; Megatron's default is TP); > 1 splits
    every expert over that many ranks, with what that split is built for (the layout itself is checked
    against the world size by ``validate_layout``)."""
    etp = p.expert_tensor_parallel_size
    if etp is None or etp == 1:
        return
    flag = f"--expert-tensor-parallel-size {etp}"
    check(etp >= 1, f"--expert-tensor-parallel-size must be >= 1, got {etp}")
    check(m.num_experts is not None, f"{flag} needs --num-experts")
    check(
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
        check(not given, f"{flag} is not supported with {what}")


def _validate_activation_offloading(m, p) -> None:
    """--cpu-offloading (activations) with what it is not built and tested for."""
    if not m.cpu_offloading:
        return
    refused = (
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
        check(not given, f"--cpu-offloading with {flag} is not supported: {why}")


def _validate_fp8_shapes(m, p, t) -> None:
    """The shapes Transformer Engine's fp8 GEMMs take."""
    tp, heads, d = p.tensor_model_parallel_size, m.num_attention_heads, m.head_dim
    widths = {
        "hidden": m.hidden_size,
        "qkv/tp": (heads + 2 * m.num_kv_heads) * d // tp,
        "heads*d/tp": heads * d // tp,
        "ffn/tp": m.ffn_hidden_size // tp,
    }  # fc1's [gate; up] width is twice ffn/tp
    bad = {name: width for name, width in widths.items() if width % 16}
    check(not bad, f"--fp8-format: Transformer Engine's fp8 GEMMs need widths divisible by 16, got {bad}")
    tokens = m.seq_length * t.micro_batch_size // (tp if p.sequence_parallel else 1)
    check(
        tokens % 8 == 0,
        f"--fp8-format: Transformer Engine's fp8 GEMMs need the tokens per rank and micro-batch "
        f"(--seq-length x --micro-batch-size, / TP under sequence parallelism) divisible by 8, "
        f"got {tokens}",
    )


def _validate_precision(m, p, t) -> None:
    """fp8 shapes, and the attention cores and reductions each precision allows."""
    if m.fp8_format is not None:
        _validate_fp8_shapes(m, p, t)
    check(
        m.attention_backend != "flash" or t.bf16 or t.fp16,
        "--attention-backend flash needs --bf16 or --fp16 (flash-attn has no fp32 kernels)",
    )
    keyed = m.position_keyed_attention_dropout or p.context_parallel_size > 1
    check(
        m.attention_backend != "blocked" or m.attention_dropout == 0 or keyed,
        f"--attention-backend blocked has no attention dropout: set --attention-dropout 0 "
        f"(got {m.attention_dropout}), --position-keyed-attention-dropout or use another backend",
    )
    check(not p.grad_reduce_in_bf16 or t.bf16, "--grad-reduce-in-bf16 needs --bf16")
    check(
        not (p.local_sgd_interval and (t.fp16 or t.calculate_per_token_loss)),
        "--local-sgd-interval is not supported with --fp16 (each replica's loss scaler would skip steps on its "
        "own) or --calculate-per-token-loss (it divides by the tokens of all data-parallel ranks)",
    )


def _validate_instances(m, p, t) -> None:
    """What --num-distributed-optimizer-instances is not built with: MoE (expert buffers shard over
    expt_dp) and the optimizers that read whole tensors from the shards (their groups span the instances)."""
    n = p.num_distributed_optimizer_instances
    if n == 1:
        return
    check(m.num_experts is None, f"--num-distributed-optimizer-instances {n} with --num-experts is not built yet")
    check(
        t.optimizer not in ("lamb", "lars", "muon"),
        f"--num-distributed-optimizer-instances {n} with --optimizer {t.optimizer} is not built yet",
    )


def step_schedule(t, seq_length: int) -> Optional[List[Tuple[int, int]]]:
    """``--step-batch-size-schedule`` as (threshold in samples, global batch) pairs, or None."""
    if t.step_batch_size_schedule is None:
        return None
    try:
        return parse_step_batch_size_schedule(t.step_batch_size_schedule, seq_length)
    except ScheduleError as e:
        raise ConfigError(f"--step-batch-size-schedule: {e}") from None


def _validate_step_schedule(m, t) -> None:
    """The schedule parses, excludes --rampup-batch-size and --global-batch-size, and sets the global
    batch size to its largest batch (what the data and learning-rate schedule are sized from)."""
    schedule = step_schedule(t, m.seq_length)
    if schedule is None:
        return
    largest = max(b for _, b in schedule)
    check(t.rampup_batch_size is None, "give only one of --step-batch-size-schedule and --rampup-batch-size")
    check(
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


def _validate_world(p, t, world_size: int, vpp: Optional[int], seq_length: int) -> None:
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
    n = p.num_distributed_optimizer_instances
    check(
        (dp * p.context_parallel_size) % n == 0,
        f"--num-distributed-optimizer-instances {n} must divide the data-parallel (x context) size "
        f"{dp * p.context_parallel_size}",
    )
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    check(t.micro_batch_size >= 1, f"--micro-batch-size must be >= 1, got {t.micro_batch_size}")
    for _, batch in step_schedule(t, seq_length) or []:
        check(
            batch % (t.micro_batch_size * dp) == 0,
            f"--step-batch-size-schedule batch {batch} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp}",
        )
        check(
            vpp is None or vpp == 1 or batch // (t.micro_batch_size * dp) % pp == 0,
            f"interleaved pipeline schedule needs the microbatches of --step-batch-size-schedule batch {batch} "
            f"to be divisible by --pipeline-model-parallel-size {pp}",
        )
    check(
        t.global_batch_size % (t.micro_batch_size * dp) == 0,
        f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
        f"{t.micro_batch_size} x data-parallel size {dp}",
    )
    if vpp is not None and vpp > 1:
        n_micro = t.global_batch_size // (t.micro_batch_size * dp)
        check(
            n_micro % pp == 0,
            f"interleaved pipeline schedule needs the number of microbatches ({n_micro}) "
            f"to be divisible by --pipeline-model-parallel-size {pp}",
        )
    if t.rampup_batch_size is not None:
        start, incr, _ = t.rampup_batch_size
        gb = t.global_batch_size
        check(
            0 < start <= gb and incr > 0 and (gb - start) % incr == 0,
            f"--rampup-batch-size start {start} and increment {incr} must step from 0 < start <= "
            f"--global-batch-size {gb} to it in whole increments",
        )
        check(
            start % (t.micro_batch_size * dp) == 0 and incr % (t.micro_batch_size * dp) == 0,
            f"--rampup-batch-size start {start} and increment {incr} must be multiples of "
            f"micro batch x DP = {t.micro_batch_size * dp}",
        )


def _validate_data(d, m, p) -> None:
    """The document mask with the attention core, the tokenizer flags (the vocabulary size is a model
    flag); sets the padded vocabulary size when the vocabulary is known."""
    thd = d.qkv_format == "thd"
    check(
        d.reset_attention_mask or not thd,
        "--qkv-format thd packs the documents of --reset-attention-mask: give --reset-attention-mask with it",
    )
    if d.reset_attention_mask:
        mode = "--reset-attention-mask" + (" --qkv-format thd" if thd else "")
        for refused, what in (
            (
                p.context_parallel_size > 1 and not thd,
                "--context-parallel-size > 1 (the CP cores take the documents packed: add --qkv-format thd)",
            ),
            (m.transformer_impl != "local", "--transformer-impl transformer_engine (TE's core is given no mask here)"),
            (
                not thd and (m.attention_backend == "flash" or m.use_flash_attn),
                "--attention-backend flash (flash-attn takes no mask; --qkv-format thd runs its varlen kernel)",
            ),
            (
                m.position_keyed_attention_dropout and not thd,
                "--position-keyed-attention-dropout (its core takes packed documents: add --qkv-format thd)",
            ),
        ):
            check(not refused, f"{mode} is not supported with {what}")
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
        check(not missing, f"--tokenizer-type {d.tokenizer_type} needs {' and '.join(missing)}")
    if m.vocab_size is not None:
        m.padded_vocab_size = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tensor_model_parallel_size)


def _validate_hang_watchdog(t, p) -> None:
    seconds, timeout = t.hang_watchdog_seconds, p.distributed_timeout_minutes * 60
    check(seconds >= 0, f"--hang-watchdog-seconds must be >= 0 (0: off), got {seconds:g}")
    check(
        seconds < timeout,
        f"--hang-watchdog-seconds {seconds:g} must be below --distributed-timeout-minutes "
        f"{p.distributed_timeout_minutes:g} ({timeout:g} s): the collective timeout would end the job first",
    )
