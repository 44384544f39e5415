"""``ParallelConfig``: how the model and data are split over processes, the data-parallel
wrapper's options (sharding, bucketing, gradient compression, local SGD) and their own checks
(against the model and the world size: :mod:`megalm.config.cross`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megalm.config.fields import Section, check
from megalm.config.fields import flag_field as _f


@dataclass
class ParallelConfig(Section):
    """How the model and data are split across processes."""

    tensor_model_parallel_size: int = _f(1, "Tensor model parallel size.")
    pipeline_model_parallel_size: int = _f(1, "Pipeline model parallel size.")
    num_layers_per_virtual_pipeline_stage: Optional[int] = _f(
        None, "Layers per virtual pipeline stage (interleaved 1F1B)."
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = _f(
        None, "Virtual pipeline stages per pipeline rank (interleaved 1F1B)."
    )
    decoder_first_pipeline_num_layers: Optional[int] = _f(None, "Layers on the first pipeline stage (uneven split).")
    decoder_last_pipeline_num_layers: Optional[int] = _f(None, "Layers on the last pipeline stage (uneven split).")
    context_parallel_size: int = _f(
        1,
        "Context parallel size: each sequence is cut into 2 x CP chunks and CP rank i "
        "holds chunks i and 2CP-1-i (equal causal work); gradients are reduced over "
        "data x context parallel ranks.",
    )
    cp_comm_type: str = _f(
        "p2p",
        "Communication of the attention core under context parallelism: p2p (ring "
        "attention, K/V sent around the ring overlapped with compute), a2a (Ulysses "
        "all-to-all, heads and KV groups per TP rank divisible by CP) or allgather "
        "(K/V all-gathered over CP).",
        choices=["p2p", "a2a", "allgather"],
    )
    expert_model_parallel_size: int = _f(1, "Expert model parallel size.")
    expert_tensor_parallel_size: Optional[int] = _f(
        None,
        "Tensor-parallel size of the experts (ETP), independent of --tensor-model-parallel-size: > 1 splits every "
        "expert over ETP adjacent ranks (fc1 column-, fc2 row-parallel; expert layout etp-ep-edp, expert DP = "
        "world / (PP x ETP x EP); the ETP group's tokens are all-gathered). Absent or "
        "1: experts whole on every rank, each TP rank running them on its own sequence slice (Megatron's default "
        "when absent is ETP = TP: same model, other memory and communication).",
    )
    sequence_parallel: bool = _f(False, "Shard norms and dropout along the sequence over tensor-parallel ranks.")
    use_distributed_optimizer: bool = _f(
        False, "Shard optimizer state and main weights over data-parallel ranks (ZeRO-1)."
    )
    data_parallel_sharding_strategy: str = _f(
        "no_shard",
        "What data-parallel ranks shard (megalm's implementation of Megatron's names; "
        "--use-megatron-fsdp is not needed and changes nothing): no_shard (plain DP), "
        "optim (= --use-distributed-optimizer, ZeRO-1), optim_grads (ZeRO-2: also the reduced gradients; "
        "each bucket's full gradient "
        "storage is freed once reduce-scattered), optim_grads_params (ZeRO-3: also the parameters, "
        "all-gathered per bucket before each module's forward and again for backward; "
        "--overlap-param-gather prefetches the next bucket).  MoE expert parameters are sharded over the "
        "expert-data-parallel group.",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
    )
    init_model_with_meta_device: bool = _f(
        False,
        "Build the model on the meta device and give parameters storage only when DDP's buffers take them, "
        "filled bucket by bucket with the same initial values as without the flag: with "
        "--data-parallel-sharding-strategy optim_grads_params a rank never holds the whole model (its shards and "
        "one bucket at most); with optim and optim_grads the weights are made in DDP's parameter buffer directly "
        "(no second copy of them); with no_shard the peak is the same.",
    )
    overlap_grad_reduce: bool = _f(False, "Reduce gradient buckets during the last microbatch's backward.")
    overlap_param_gather: bool = _f(
        False,
        "All-gather updated parameters during the next forward (distributed optimizer); with "
        "--data-parallel-sharding-strategy optim_grads_params (as Megatron-FSDP): prefetch, the next "
        "bucket's all-gather in flight while the current one is used, in forward and in backward.",
    )
    ddp_bucket_size: Optional[int] = _f(None, "Gradient bucket size in elements; default max(40M, 1M x DP).")
    hierarchical_grad_reduce: bool = _f(
        False,
        "Topology-aware data-parallel reduction (megalm): each gradient bucket "
        "is reduce-scattered inside the node, all-reduced across nodes among "
        "the ranks with the same local index (1/L of it per rank), and "
        "all-gathered inside the node; with --use-distributed-optimizer "
        "reduce-scattered inside then across nodes and the parameters "
        "gathered back the same way.  Same results as the flat collectives "
        "up to summation order; nodes are consecutive blocks of "
        "LOCAL_WORLD_SIZE ranks, and the data-parallel group must have the "
        "same number of ranks on every node.",
    )
    num_distributed_optimizer_instances: int = _f(
        1,
        "Partial distributed optimizer (Megatron-core's num_distributed_optimizer_instances): the data-parallel "
        "(x context) ranks are cut into this many instances of consecutive ranks (give a node's worth each); the "
        "optimizer state and main weights are sharded over the DP/N ranks of one instance and replicated across "
        "instances.  Each gradient bucket is reduce-scattered inside the instance, each rank's shard (1/(DP/N) of "
        "the bucket) all-reduced across the instances (the only collective between them), and the parameters "
        "all-gathered inside the instance.  With --data-parallel-sharding-strategy optim_grads / optim_grads_params "
        "(HSDP, as Megatron-FSDP) the reduced gradients and the weights are sharded over the instance too.  Needs "
        "--use-distributed-optimizer; N must divide the data-parallel (x context) size.",
    )
    grad_compression: str = _f(
        "none",
        "Compress the data-parallel gradient reduction (megalm), with error feedback (what a rank did "
        "not send is added to its next step's gradient): powersgd (rank --powersgd-rank approximation "
        "of every matrix, two all-reduces; vectors and small matrices exact), topk (all-gather of the "
        "--topk-ratio largest-magnitude entries and their indices), int8 (all-gather of 8-bit values "
        "with one fp32 scale per --int8-chunk-size elements), int4 (the same with 4-bit values, two per "
        "byte, --int8-chunk-size and --int8-rounding), fp8 (the same as int8 with fp8 values, "
        "--grad-fp8-format).  Once per step (after gradient accumulation); with --hierarchical-grad-reduce "
        "only the inter-node leg.  With --use-distributed-optimizer each rank keeps its shard of the same "
        "result (int8/fp8: an all-to-all instead of the all-gather); not with the optim_grads / "
        "optim_grads_params strategies.  Checkpoints keep the state; loaded under another layout the "
        "residuals are resharded (each rank gets its share of the pending update).  Across torchft replica "
        "groups (--ft-replica-group-id): int8 or powersgd, compressing the groups' average (inside a group "
        "the reduction stays exact).",
        choices=["none", "powersgd", "topk", "int8", "int4", "fp8"],
    )
    grad_compression_warmup_iters: int = _f(
        0,
        "Warm-up of exact steps before --grad-compression starts (megalm; PowerSGD's start_powerSGD_iter): the "
        "first this many iterations reduce gradients exactly (the run is the uncompressed one, bit for bit), "
        "compression and error feedback start at the next one.",
    )
    powersgd_rank: int = _f(4, "Rank of PowerSGD's low-rank gradient approximation (--grad-compression powersgd).")
    topk_ratio: float = _f(0.01, "Fraction of each bucket's entries sent by --grad-compression topk, in (0, 1].")
    int8_chunk_size: int = _f(1024, "Elements sharing one fp32 scale under --grad-compression int8 and int4.")
    int8_rounding: str = _f(
        "nearest",
        "Rounding of --grad-compression int8 and int4: nearest, or stochastic (unbiased; a different random "
        "stream per rank, saved in checkpoints).",
        choices=["nearest", "stochastic"],
    )
    grad_fp8_format: str = _f(
        "e4m3",
        "fp8 format of --grad-compression fp8: e4m3 (3 mantissa bits, largest 448) or e5m2 (2 mantissa "
        "bits, largest 57344); each chunk is scaled so that its largest magnitude is the format's largest.",
        choices=["e4m3", "e5m2"],
    )
    grad_fp8_chunk_size: int = _f(1024, "Elements sharing one fp32 scale under --grad-compression fp8.")
    grad_fp8_rounding: str = _f(
        "nearest",
        "Rounding of --grad-compression fp8: nearest (ties to even), or stochastic (to one of the two "
        "neighbouring fp8 values, unbiased; a different random stream per rank, saved in checkpoints).",
        choices=["nearest", "stochastic"],
    )
    local_sgd_interval: int = _f(
        0,
        "Local SGD / DiLoCo (megalm): data-parallel replicas step independently with their own "
        "optimizer (gradients reduced over no rank, or with --hierarchical-grad-reduce inside the "
        "node only) and their parameters are averaged every this many iterations over the "
        "data-parallel group (hierarchical: across nodes); 0 = synchronous data parallelism.  "
        "Checkpoints keep every replica's weights and optimizer state per rank.",
    )
    local_sgd_warmup_iters: int = _f(
        0,
        "Local SGD / DiLoCo (megalm): a warm-up phase of synchronous data parallelism (the gradients "
        "all-reduced over the data-parallel group every step, as without --local-sgd-interval) for the "
        "first this many iterations; the replicas then start stepping on their own from the same weights "
        "and optimizer state, and synchronise every --local-sgd-interval iterations after the warm-up.",
    )
    local_sgd_fragments: int = _f(
        1,
        "Streaming DiLoCo (megalm): split the parameters into this many fragments of contiguous layers, each "
        "synchronised every --local-sgd-interval iterations but staggered (fragment f at W + k H + (f+1) H / F), "
        "so each sync sends 1/F of the bytes; with --local-sgd-overlap-steps (at most H / F) it is hidden behind "
        "the next iterations.  The last iteration synchronises every fragment.  1 = every parameter at once.",
    )
    outer_grad_int8_chunk: int = _f(
        0,
        "Local SGD / DiLoCo (megalm; Streaming DiLoCo's quantized outer gradients): send each replica's "
        "pseudo-gradient x0 - x in 8 bits with one fp32 scale per this many elements (one all-gather, about a "
        "quarter of the fp32 average's bytes; nearest rounding, no error feedback) instead of its fp32 "
        "parameters; 0 = fp32.",
    )
    local_sgd_overlap_steps: int = _f(
        0,
        "Local SGD / DiLoCo (megalm): overlap the parameter average with this many following training "
        "iterations (0 = blocking, the default).  The average of the parameters snapshotted at a sync "
        "is all-reduced in the background and applied this many iterations later as a correction that "
        "keeps each replica's progress since the snapshot: x <- x + (outer(average) - snapshot).  At most "
        "--local-sgd-interval; a sync due at the run's last iteration (--train-iters) is blocking.",
    )
    outer_lr: float = _f(
        1.0,
        "DiLoCo outer learning rate: every --local-sgd-interval steps x <- x0 - outer_lr (D + "
        "outer_momentum m) with D = x0 - average (x0: the parameters at the last sync); 1 with "
        "--outer-momentum 0 is plain parameter averaging.",
    )
    outer_momentum: float = _f(
        0.0, "DiLoCo outer Nesterov momentum: m <- outer_momentum m + D (see --outer-lr); DiLoCo uses 0.9."
    )
    accumulate_allreduce_grads_in_fp32: bool = _f(
        True, "Accumulate and reduce gradients in fp32 (on unless --grad-reduce-in-bf16)."
    )
    megatron_fsdp_main_grads_dtype: str = _f(
        "auto",
        "Dtype of the gradient buffers (accumulation and the optimizer's main gradients): fp32 = "
        "--accumulate-allreduce-grads-in-fp32; bf16 / fp16 = the parameters' dtype (needs --bf16 / --fp16); auto: "
        "as the other flags say.",
        choices=["fp32", "bf16", "fp16", "auto"],
    )
    megatron_fsdp_grad_comm_dtype: str = _f(
        "auto",
        "Dtype the gradients are reduced in over data-parallel ranks. megalm reduces in its gradient buffers, so "
        "this sets their dtype as --megatron-fsdp-main-grads-dtype does (auto: the main-gradient dtype); the two "
        "must agree when both are given.",
        choices=["fp32", "bf16", "fp16", "auto"],
    )
    grad_reduce_in_bf16: bool = _f(
        False,
        "With --bf16: accumulate and reduce gradients in bf16 (half the data-parallel bytes; the optimizer "
        "still steps fp32 main weights on an fp32 copy of the gradients).",
    )
    variable_seq_lengths: bool = _f(False, "Exchange tensor shapes between pipeline stages each microbatch.")
    distributed_timeout_minutes: float = _f(
        10, "Timeout of every collective, in minutes (fractions allowed); a timeout names its group."
    )
    auto_layout: bool = _f(
        False,
        "pretrain_gpt.py (megalm): run the layout planner (megalm-plan, docs/planner.md) for this world size and "
        "--cluster-config at start-up and train with its first choice's parallel flags (TP, PP, VPP, CP, EP, "
        "sharding, recompute, micro batch, offload); refused with explicit layout flags.",
    )
    cluster_config: Optional[str] = _f(
        None,
        "--auto-layout's cluster: a megalm-plan preset (h100, a100, cpu-sim, cpu) or cluster TOML file (nodes and "
        "devices per node come from the world and LOCAL_WORLD_SIZE); default: h100 with CUDA, else cpu.",
    )

    ft_replica_group_id: Optional[int] = _f(
        None,
        "torchft fault-tolerant data parallelism across replica groups: this group's id in [0, "
        "--ft-num-replica-groups); every rank of the group (its own torchrun, TP/PP/DP inside) gives the same id "
        "(needs the [ft] extra: pip install megalm[ft]; megalm's flag, after torchtitan's "
        "--fault_tolerance.replica_id).",
    )
    ft_num_replica_groups: int = _f(
        0,
        "Most replica groups training together under torchft; --global-batch-size is the batch of all of them, and "
        "every quorum of --ft-min-replicas to this many groups splits it evenly (megalm's flag).",
    )
    ft_lighthouse: Optional[str] = _f(
        None,
        "Address of the torchft lighthouse (e.g. http://host:29510; started with torchft_lighthouse "
        "--min_replicas 1); default: the TORCHFT_LIGHTHOUSE environment variable (megalm's flag).",
    )
    ft_min_replicas: int = _f(
        1, "Fewest replica groups that may commit a step under torchft; fewer wait (megalm's flag)."
    )
    ft_timeout_seconds: float = _f(
        60.0,
        "torchft's timeout for the cross-group collectives, the commit vote and a recovery transfer; a quorum waits "
        "twice as long (megalm's flag).",
    )

    # Derived.
    world_size: Optional[int] = field(default=None, metadata={"derived": True})
    data_parallel_size: Optional[int] = field(default=None, metadata={"derived": True})
    virtual_pipeline_model_parallel_size: Optional[int] = field(default=None, metadata={"derived": True})

    def validate(self) -> None:
        """Sizes, sharding strategy (made consistent with --use-distributed-optimizer), the data-parallel
        wrapper's flags, gradient compression, local SGD and the collective timeout."""
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        check(tp >= 1 and pp >= 1, f"parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})")
        check(cp >= 1, f"--context-parallel-size must be >= 1, got {cp}")
        self._validate_sharding_strategy()
        if self.grad_reduce_in_bf16:
            self.accumulate_allreduce_grads_in_fp32 = False  # DDP's buffers take the parameters' dtype: bf16
        check(
            not self.overlap_param_gather or self.use_distributed_optimizer,
            "--overlap-param-gather needs --use-distributed-optimizer (it overlaps the optimizer's parameter "
            "all-gather)",
        )
        check(
            self.ddp_bucket_size is None or self.ddp_bucket_size > 0,
            f"--ddp-bucket-size must be positive, got {self.ddp_bucket_size}",
        )
        self._validate_grad_compression()
        check(self.cluster_config is None or self.auto_layout, "--cluster-config needs --auto-layout")
        self._validate_local_sgd()
        self._validate_instances()
        if self.sequence_parallel and tp == 1:
            self.sequence_parallel = False  # as Megatron: a no-op without tensor parallelism
        check(self.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be positive")

    def _validate_sharding_strategy(self) -> None:
        """``--data-parallel-sharding-strategy`` and ``--use-distributed-optimizer`` made consistent:
        every strategy but ``no_shard`` turns the distributed optimizer on, and the distributed optimizer
        alone means ``optim``.  ``optim_grads`` and ``optim_grads_params`` are refused where they are not built;
        with MoE, expert parameters are sharded over the expert-data-parallel group
        (:mod:`megalm.distributed.sharded_param_buffer`)."""
        s = self.data_parallel_sharding_strategy
        if s == "no_shard" and self.use_distributed_optimizer:
            self.data_parallel_sharding_strategy = s = "optim"
        if s != "no_shard":
            self.use_distributed_optimizer = True
        if s in ("no_shard", "optim"):
            return
        for flag, size in (
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
            ("--expert-tensor-parallel-size", self.expert_tensor_parallel_size or 1),
        ):
            check(size == 1, f"--data-parallel-sharding-strategy {s} with {flag} {size} is not built yet")
        check(
            not self.hierarchical_grad_reduce,
            f"--data-parallel-sharding-strategy {s} with --hierarchical-grad-reduce is not built yet",
        )

    def _validate_instances(self) -> None:
        """``--num-distributed-optimizer-instances``: positive, with the distributed optimizer (ZeRO-1, or HSDP with
        ZeRO-2/3), and
        none of the reductions it is not built with (the data-parallel size is checked against it by
        :func:`megalm.config.cross.validate_cross`)."""
        n = self.num_distributed_optimizer_instances
        check(n >= 1, f"--num-distributed-optimizer-instances must be >= 1, got {n}")
        if n == 1:
            return
        flag = f"--num-distributed-optimizer-instances {n}"
        check(self.use_distributed_optimizer, f"{flag} needs --use-distributed-optimizer")
        for refused, what in (
            (self.hierarchical_grad_reduce, "--hierarchical-grad-reduce"),
            (self.grad_compression != "none", f"--grad-compression {self.grad_compression}"),
            (self.local_sgd_interval > 0, "--local-sgd-interval"),
            (self.ft_replica_group_id is not None, "--ft-replica-group-id"),
        ):
            check(not refused, f"{flag} with {what} is not built yet")

    def _validate_grad_compression(self) -> None:
        """``--grad-compression`` and its method's settings."""
        if self.grad_compression == "none":
            check(
                not self.grad_compression_warmup_iters,
                "--grad-compression-warmup-iters needs --grad-compression",
            )
            return
        check(
            self.grad_compression_warmup_iters >= 0,
            f"--grad-compression-warmup-iters must be >= 0, got {self.grad_compression_warmup_iters}",
        )
        check(self.powersgd_rank >= 1, f"--powersgd-rank must be >= 1, got {self.powersgd_rank}")
        check(0 < self.topk_ratio <= 1, f"--topk-ratio must be in (0, 1], got {self.topk_ratio}")
        check(self.int8_chunk_size >= 1, f"--int8-chunk-size must be >= 1, got {self.int8_chunk_size}")
        check(self.grad_fp8_chunk_size >= 1, f"--grad-fp8-chunk-size must be >= 1, got {self.grad_fp8_chunk_size}")

    def _validate_local_sgd(self) -> None:
        """``--local-sgd-interval`` and the outer optimizer; what local SGD is not built for."""
        interval = self.local_sgd_interval
        check(interval >= 0, f"--local-sgd-interval must be >= 0, got {interval}")
        for flag, value in (
            ("--local-sgd-overlap-steps", self.local_sgd_overlap_steps),
            ("--local-sgd-warmup-iters", self.local_sgd_warmup_iters),
            ("--local-sgd-fragments", self.local_sgd_fragments - 1),
            ("--outer-grad-int8-chunk", self.outer_grad_int8_chunk),
        ):
            check(value == 0 or interval > 0, f"{flag} needs --local-sgd-interval")
        check(
            self.local_sgd_warmup_iters >= 0,
            f"--local-sgd-warmup-iters must be >= 0, got {self.local_sgd_warmup_iters}",
        )
        if not interval:
            return
        check(
            0 <= self.local_sgd_overlap_steps <= interval,
            f"--local-sgd-overlap-steps must be in [0, --local-sgd-interval] = [0, {interval}], "
            f"got {self.local_sgd_overlap_steps}",
        )
        check(
            self.outer_grad_int8_chunk >= 0, f"--outer-grad-int8-chunk must be >= 0, got {self.outer_grad_int8_chunk}"
        )
        frags = self.local_sgd_fragments
        check(
            frags >= 1 and interval % frags == 0 and self.local_sgd_overlap_steps <= interval // frags,
            f"--local-sgd-fragments must divide --local-sgd-interval {interval} and --local-sgd-overlap-steps "
            f"must be at most --local-sgd-interval / --local-sgd-fragments (one fragment in flight), got "
            f"{frags} fragments, {self.local_sgd_overlap_steps} overlap steps",
        )
        check(self.outer_lr > 0, f"--outer-lr must be positive, got {self.outer_lr}")
        check(0 <= self.outer_momentum < 1, f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        for refused, why in (
            (self.use_distributed_optimizer, "--use-distributed-optimizer (the replicas' optimizer states differ)"),
            (
                self.grad_compression != "none",
                f"--grad-compression {self.grad_compression} (no data-parallel gradient reduction)",
            ),
            (
                self.context_parallel_size > 1,
                "--context-parallel-size > 1 (context-parallel ranks of a replica must stay in step)",
            ),
            (self.expert_model_parallel_size > 1, "--expert-model-parallel-size > 1"),
        ):
            check(not refused, f"--local-sgd-interval {interval} is not supported with {why}")
