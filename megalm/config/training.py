"""``TrainingConfig``: batches, schedule, optimizer, precision and stopping, with the checks that
need nothing else (the learning-rate schedule's: :mod:`megalm.config.lr_schedule`; against the
world size and the model: :mod:`megalm.config.cross`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List, Optional

from megalm.config.fields import ConfigError, Section, check
from megalm.config.fields import flag_field as _f


@dataclass
class TrainingConfig(Section):
    """Batches, schedule, optimizer, precision and stopping."""

    micro_batch_size: int = _f(1, "Samples per microbatch per data-parallel rank.")
    global_batch_size: Optional[int] = _f(None, "Samples per iteration over all ranks; default micro x DP.")
    rampup_batch_size: Optional[List[int]] = _f(
        None,
        "Batch size ramp-up: <start> <increment> <ramp-up samples>; with --train-samples or --train-iters (then "
        "that many iterations, each batch by the samples consumed so far, as Megatron-LM).",
        nargs=3,
    )
    step_batch_size_schedule: Optional[str] = _f(
        None,
        "Global batch size by consumed tokens: '<tokens>:<batch> ...', e.g. '0:16 2.4B:320' (suffixes K M B T; "
        "the first threshold 0; tokens become samples by floor division by --seq-length). Sets the global "
        "batch size itself (not with --global-batch-size or --rampup-batch-size); with --train-samples or "
        "--train-iters. The learning rate follows the batch only with --lr-batch-scaling.",
    )
    lr_batch_scaling: str = _f(
        "none",
        "megalm's (Megatron has none): scale the learning rate with the batch of each iteration under "
        "--rampup-batch-size or --step-batch-size-schedule. --lr (and --min-lr, the whole schedule) is the value at "
        "the global batch size (the largest batch); an iteration of batch b uses it x b / global batch (linear) "
        "or x sqrt(b / global batch) (sqrt); none: unscaled (--step-batch-size-schedule then warns with both rules).",
        choices=["none", "linear", "sqrt"],
    )
    train_iters: Optional[int] = _f(None, "Iterations to train (or --train-samples).")
    train_samples: Optional[int] = _f(None, "Samples to train (or --train-iters).")
    seed: int = _f(1234, "Random seed (weights, dropout, data order).")
    deterministic_mode: bool = _f(
        False,
        "torch.use_deterministic_algorithms(True) (and CUBLAS_WORKSPACE_CONFIG on CUDA): an op without a "
        "deterministic kernel raises instead of running.",
    )
    optimizer: str = _f(
        "adam",
        "Optimizer: adam is AdamW (decoupled weight decay); sgd (momentum, L2 decay); lamb (Adam direction "
        "times a per-tensor trust ratio ||w||/||update||, clamped at 10); lars (SGD momentum with the "
        "per-tensor local learning rate of --lars-trust-coefficient); lion (sign of interpolated momentum); muon "
        "(Newton-Schulz-orthogonalized momentum for the linear layers' weights, --muon-scalar-optimizer for the rest). "
        "LAMB and LARS leave biases and norm weights out of the trust ratio; their norms are of the full "
        "tensor under every parallel layout.",
        choices=["adam", "sgd", "lamb", "lars", "lion", "muon"],
    )
    lr: float = _f(1e-4, "Peak learning rate.")
    min_lr: float = _f(0.0, "Minimum learning rate after decay.")
    lr_decay_style: str = _f(
        "linear", "Learning-rate decay.", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"]
    )
    lr_warmup_iters: int = _f(0, "Linear warm-up iterations.")
    lr_warmup_fraction: Optional[float] = _f(None, "Warm-up as a fraction of --lr-decay-iters.")
    lr_warmup_init: float = _f(0.0, "Learning rate at the start of warm-up.")
    lr_decay_iters: Optional[int] = _f(None, "Iterations to decay over; default --train-iters.")
    lr_decay_samples: Optional[int] = _f(None, "Samples to decay over (with --train-samples).")
    lr_warmup_samples: Optional[int] = _f(None, "Warm-up samples (with --train-samples).")
    lr_wsd_decay_samples: Optional[int] = _f(None, "Samples of WSD's final decay phase (with --train-samples).")
    override_opt_param_scheduler: bool = _f(False, "On load, use the learning-rate schedule of the command line.")
    use_checkpoint_opt_param_scheduler: bool = _f(
        False, "On load, use the learning-rate schedule saved in the checkpoint."
    )
    lr_wsd_decay_style: str = _f(
        "exponential", "Annealing shape of WSD's decay phase.", choices=["exponential", "linear", "cosine"]
    )
    lr_wsd_decay_iters: Optional[int] = _f(None, "Length of WSD's final decay phase.")
    weight_decay: float = _f(0.01, "Decoupled weight decay (not applied to biases and norms).")
    decoupled_lr: Optional[float] = _f(
        None, "Peak learning rate of the word embedding and output layer (their own schedule; default --lr)."
    )
    decoupled_min_lr: Optional[float] = _f(
        None, "Final learning rate of the word embedding and output layer with --decoupled-lr (default --min-lr)."
    )
    start_weight_decay: Optional[float] = _f(
        None, "Weight decay at the start of training with --weight-decay-incr-style linear or cosine."
    )
    end_weight_decay: Optional[float] = _f(
        None, "Weight decay at the end of training with --weight-decay-incr-style linear or cosine."
    )
    weight_decay_incr_style: str = _f(
        "constant",
        "How weight decay goes from --start-weight-decay to --end-weight-decay over training "
        "(constant: --weight-decay throughout).",
        choices=["constant", "linear", "cosine"],
    )
    adam_beta1: float = _f(0.9, "Adam beta1.")
    adam_beta2: float = _f(0.999, "Adam beta2.")
    adam_eps: float = _f(1e-8, "Adam epsilon.")
    sgd_momentum: float = _f(0.9, "SGD momentum (also LARS').")
    lars_trust_coefficient: float = _f(
        0.001, "LARS trust coefficient eta: local lr = eta ||w|| / (||g|| + weight decay ||w||)."
    )
    lion_beta1: float = _f(0.9, "Lion beta1: interpolation of momentum and gradient for the sign (megalm's flag).")
    lion_beta2: float = _f(0.99, "Lion beta2: momentum decay (megalm's flag).")
    muon_momentum: float = _f(0.95, "Muon momentum (the matrices' momentum buffer decay).")
    muon_split_qkv: bool = _f(
        True,
        "Muon: orthogonalize the fused QKV weight as a whole matrix (Megatron-LM's --muon-no-split-qkv). "
        "Default (as Megatron-LM): split it into its query, key and value parts (every query group's rows of "
        "each, in group order), each orthogonalized and scaled by its own shape.",
        flag="--muon-no-split-qkv",
        action="store_false",
    )
    muon_use_nesterov: bool = _f(
        False,
        "Muon: orthogonalize the Nesterov direction (1 - mu) g + mu m (--muon-nesterov: Megatron-LM's newer spelling).",
        aliases=["--muon-nesterov"],
    )
    muon_num_ns_steps: int = _f(5, "Muon: quintic Newton-Schulz iterations per step.")
    muon_scale_mode: str = _f(
        "spectral",
        "Muon update scale for an out x in matrix: spectral sqrt(max(out, in)), unit_rms_norm sqrt(out/in), "
        "shape_scaling sqrt(max(1, out/in)).",
        choices=["spectral", "unit_rms_norm", "shape_scaling"],
    )
    muon_extra_scale_factor: float = _f(1.0, "Muon: extra factor on the update (e.g. 0.2 to match AdamW's RMS).")
    muon_scalar_optimizer: str = _f(
        "adam", "Muon: optimizer of the non-matrix parameters, embeddings and output layer.", choices=["adam"]
    )
    muon_fp32_matmul_prec: str = _f(
        "highest",
        "Muon: precision of the Newton-Schulz iterations (Megatron-LM's flag): medium iterates in bf16 "
        "(Megatron-LM's default; parallel layouts then agree only to bf16 rounding); high in fp32 with "
        "torch.set_float32_matmul_precision('high') (TF32 where the device has it); highest (megalm's "
        "addition and default) in IEEE fp32, so every layout trains to one process's numbers. low is "
        "refused: torch has no such precision (Megatron-LM passes it on and torch ignores it).",
        choices=["low", "medium", "high", "highest"],
    )
    muon_coefficient_type: str = _f(
        "quintic",
        "Muon: Newton-Schulz (a, b, c) sets (Megatron-LM's flag, default and values): quintic, five sets in "
        "turn (--muon-num-ns-steps a multiple of 5); simple, (3.4445, -4.7750, 2.0315) every step (megalm's "
        "before this flag); polar_express, eight sets (8 steps or more); aol, four sets (a multiple of 4).",
        choices=["simple", "quintic", "polar_express", "aol"],
    )
    muon_tp_mode: str = _f(
        "blockwise",
        "Muon under tensor parallelism: duplicated all-gathers each split matrix and orthogonalizes it whole "
        "(equals one process); blockwise orthogonalizes each rank's shard (no communication, a different "
        "update); distributed is not built (refused).",
        choices=["blockwise", "duplicated", "distributed"],
    )
    optimizer_cpu_offload: bool = _f(
        False,
        "Run the optimizer update of --optimizer-offload-fraction of the main parameters on the CPU: "
        "their optimizer state (any --optimizer) lives in host memory, gradients are copied to the host and "
        "updated weights back; LAMB/LARS norms and Muon's matrices still cover the full tensors.",
    )
    optimizer_offload_fraction: float = _f(
        1.0,
        "Fraction of the main parameters (by elements, whole tensors) updated on the CPU with --optimizer-cpu-offload.",
    )
    overlap_cpu_optimizer_d2h_h2d: bool = _f(
        False,
        "With --optimizer-cpu-offload: copy gradients to the host bucket by bucket, each bucket's copy overlapping "
        "the CPU update of the previous one, and updated weights back as each bucket's update ends (LAMB, LARS, "
        "Muon: every bucket's gradients first, for their full-tensor norms and matrices; then bucket by bucket).",
    )
    optimizer_offload_device: str = _f(
        "cpu",
        "Where the offloaded optimizer state lives: cpu (host memory, with --optimizer-cpu-offload) or nvme (files "
        "under --offload-path: the fp32 main weights and the moments of the offloaded parameters, read and written "
        "bucket by bucket in a background thread each step; implies --optimizer-cpu-offload; adam, sgd, lion only; "
        "megalm's flag, after DeepSpeed's offload_optimizer.device).",
        choices=["cpu", "nvme"],
    )
    offload_path: Optional[str] = _f(
        None,
        "--optimizer-offload-device nvme: an existing, writable directory on local disk for the swap files (one per "
        "rank and bucket; removed at exit; DeepSpeed's nvme_path).",
    )
    clip_grad: float = _f(1.0, "Clip gradients to this global L2 norm (0 disables).")
    log_num_zeros_in_grad: bool = _f(False, "Count zero gradient entries and log them.")
    calculate_per_token_loss: bool = _f(
        False,
        "Loss = sum over all tokens / number of loss-mask tokens across "
        "microbatches and data-parallel ranks (instead of the mean of "
        "per-microbatch means).",
    )
    bf16: bool = _f(False, "bf16 weights and compute, fp32 main weights and gradients.")
    fp16: bool = _f(False, "fp16 weights and compute, fp32 main weights, dynamic loss scaling.")
    loss_scale: Optional[float] = _f(None, "Static loss scale (fp16); dynamic when unset.")
    initial_loss_scale: float = _f(2.0**32, "Initial dynamic loss scale.")
    min_loss_scale: float = _f(1.0, "Minimum dynamic loss scale.")
    loss_scale_window: int = _f(1000, "Iterations without overflow before the scale doubles.")
    hysteresis: int = _f(2, "Overflows tolerated before the scale halves.")
    check_for_nan_in_loss_and_grad: bool = _f(
        True,
        "Stop every rank, without saving, at the first non-finite loss (any rank) or gradient norm "
        "(bf16/fp32; fp16 skips overflows instead, see --max-overflows-at-min-loss-scale); "
        "--no-check-for-nan-in-loss-and-grad skips such iterations and goes on.",
        action=argparse.BooleanOptionalAction,
    )
    max_overflows_at_min_loss_scale: int = _f(
        10,
        "fp16: stop after this many consecutive overflow-skipped iterations at the minimum loss scale "
        "(--min-loss-scale, or the constant --loss-scale); 0 never stops (megalm's flag: Megatron-LM has none).",
    )
    check_for_spiky_loss: bool = _f(
        False,
        "Check each iteration's lm loss against --spiky-loss-factor x the mean of "
        "the previous --spiky-loss-window iterations (one host copy per step).",
    )
    spiky_loss_factor: float = _f(
        10.0, "A loss above this many times the running mean is spiky (Megatron's SPIKY_LOSS_FACTOR)."
    )
    spiky_loss_window: int = _f(100, "Iterations in the running mean of --check-for-spiky-loss.")
    spiky_loss_action: str = _f(
        "warn",
        "On a spiky loss: log a warning and go on, or stop every rank without "
        "saving (rollback to the last checkpoint is not built: refused).",
        choices=["warn", "stop", "rollback"],
    )
    eval_interval: int = _f(1000, "Evaluate on the validation split every this many iterations.")
    eval_iters: int = _f(100, "Validation iterations per evaluation (0 disables).")
    exit_interval: Optional[int] = _f(None, "Save and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: Optional[float] = _f(None, "Save and exit after this many minutes.")
    exit_signal_handler: bool = _f(False, "On SIGTERM finish the step, save and exit 0.")
    skip_train: bool = _f(False, "Only evaluate.")
    hang_watchdog_seconds: float = _f(
        0.0,
        "Dump every rank's Python stacks (stderr and --hang-watchdog-dir) when training makes no progress "
        "for this many seconds; must be below --distributed-timeout-minutes (0: off).",
    )
    hang_watchdog_dir: Optional[str] = _f(
        None, "Where the hang watchdog appends rank_<rank>.txt (default: <--save>/hang_stacks; none: stderr only)."
    )
    straggler_rebalance_interval: int = _f(
        0,
        "Every this many iterations, re-split each global batch's micro-batches between data-parallel replicas "
        "in proportion to their measured speed, so a slow replica does fewer (needs --calculate-per-token-loss "
        "and --dataloader-type single; the loss is the balanced run's up to summation order; 0: off; megalm's flag).",
    )
    first_step_timeout_seconds: float = _f(
        300.0,
        "Fail fast, naming the rank(s) and host(s), when a rank has not finished its first training step this "
        "many seconds after set-up ended (exit code 75, which torchrun --max-restarts restarts); raise it for "
        "first steps that compile for minutes (0: off; megalm's flag).",
    )

    def validate(self) -> None:
        """Optimizer offload, precision, numerics checks, optimizer hyper-parameters, batch scaling, the
        training length and the learning-rate schedule's flags."""
        check(
            not self.overlap_cpu_optimizer_d2h_h2d or self.offloads_optimizer,
            "--overlap-cpu-optimizer-d2h-h2d needs --optimizer-cpu-offload",
        )
        self._validate_nvme_offload()
        f = self.optimizer_offload_fraction
        check(0.0 < f <= 1.0, f"--optimizer-offload-fraction must be in (0, 1], got {f}")
        check(not (self.bf16 and self.fp16), "--bf16 and --fp16 are mutually exclusive")
        check(self.loss_scale is None or self.fp16, "--loss-scale needs --fp16")
        check(self.loss_scale_window >= 1 and self.hysteresis >= 1, "--loss-scale-window and --hysteresis must be >= 1")
        self._validate_numerics_checks()
        self._validate_optimizer()
        check(
            self.lr_batch_scaling == "none"
            or self.rampup_batch_size is not None
            or self.step_batch_size_schedule is not None,
            f"--lr-batch-scaling {self.lr_batch_scaling} needs --rampup-batch-size or --step-batch-size-schedule "
            "(with a constant batch there is nothing to scale: set --lr itself)",
        )
        check(
            not (self.train_iters is not None and self.train_samples is not None),
            "give only one of --train-iters and --train-samples",
        )
        first = self.first_step_timeout_seconds
        check(first >= 0, f"--first-step-timeout-seconds must be >= 0 (0: off), got {first:g}")
        self._validate_rebalance()
        from megalm.config.lr_schedule import validate_lr_schedule_flags

        validate_lr_schedule_flags(self)

    def _validate_rebalance(self) -> None:
        n = self.straggler_rebalance_interval
        check(n >= 0, f"--straggler-rebalance-interval must be >= 0 (0: off), got {n}")
        if not n:
            return
        check(
            self.calculate_per_token_loss,
            "--straggler-rebalance-interval needs --calculate-per-token-loss: replicas with different micro-batch "
            "counts are weighted by tokens only then (the mean of per-micro-batch means would weight them unevenly)",
        )
        check(
            not self.rampup_batch_size and not self.step_batch_size_schedule,
            "--straggler-rebalance-interval needs a constant global batch (no --rampup-batch-size or "
            "--step-batch-size-schedule)",
        )

    def _validate_numerics_checks(self) -> None:
        """--max-overflows-at-min-loss-scale and --check-for-spiky-loss's options."""
        check(
            self.max_overflows_at_min_loss_scale >= 0,
            f"--max-overflows-at-min-loss-scale must be >= 0 (0 never stops), got "
            f"{self.max_overflows_at_min_loss_scale}",
        )
        check(self.spiky_loss_factor > 1.0, f"--spiky-loss-factor must be > 1, got {self.spiky_loss_factor}")
        check(self.spiky_loss_window >= 1, f"--spiky-loss-window must be >= 1, got {self.spiky_loss_window}")
        check(
            self.spiky_loss_action != "rollback",
            "--spiky-loss-action rollback (reload the last checkpoint and skip the batch) is not built in megalm; "
            "use warn or stop",
        )

    @property
    def offloads_optimizer(self) -> bool:
        """The optimizer update of --optimizer-offload-fraction runs on the host (state in RAM or on disk)."""
        return self.optimizer_cpu_offload or self.optimizer_offload_device == "nvme"

    def _validate_nvme_offload(self) -> None:
        """--optimizer-offload-device nvme: a usable --offload-path and an element-wise optimizer."""
        if self.optimizer_offload_device != "nvme":
            check(self.offload_path is None, "--offload-path needs --optimizer-offload-device nvme")
            return
        check(self.offload_path is not None, "--optimizer-offload-device nvme needs --offload-path DIR")
        check(
            self.optimizer in ("adam", "sgd", "lion"),
            f"--optimizer-offload-device nvme swaps the state bucket by bucket, so it takes element-wise optimizers "
            f"(adam, sgd, lion); --optimizer {self.optimizer} needs every tensor's state at once for its norms or "
            "matrices: use --optimizer-offload-device cpu",
        )
        from megalm.optimizer.swap_files import check_swap_dir

        problem = check_swap_dir(self.offload_path)
        check(problem is None, problem)

    def _validate_optimizer(self) -> None:
        """--optimizer and its hyper-parameters."""
        if self.optimizer == "lars":
            check(
                self.lars_trust_coefficient > 0,
                f"--lars-trust-coefficient must be > 0, got {self.lars_trust_coefficient}",
            )
        if self.optimizer == "muon":
            self._validate_muon()
        if self.optimizer == "lion":
            for flag, beta in (("--lion-beta1", self.lion_beta1), ("--lion-beta2", self.lion_beta2)):
                check(0.0 <= beta < 1.0, f"{flag} must be in [0, 1), got {beta}")

    def _validate_muon(self) -> None:
        """Muon's flags (with the distributed optimizer the matrices are assembled: supported)."""
        check(
            self.muon_tp_mode != "distributed",
            "--muon-tp-mode distributed is not built; use duplicated (gathers each matrix: equals one process) "
            "or blockwise (orthogonalizes each TP shard)",
        )
        check(
            self.muon_fp32_matmul_prec != "low",
            "--muon-fp32-matmul-prec low is not supported: torch has no 'low' float32 matmul precision (Megatron-LM "
            "passes it to torch.set_float32_matmul_precision, which ignores it with a warning); use medium "
            "(Megatron-LM's default), high or highest (IEEE fp32)",
        )
        check(self.muon_num_ns_steps >= 1, f"--muon-num-ns-steps must be >= 1, got {self.muon_num_ns_steps}")
        from megalm.optimizer.muon import MuonError, ns_coefficients  # lazy: the config needs no optimizer imports

        try:
            ns_coefficients(self.muon_coefficient_type, self.muon_num_ns_steps)
        except MuonError as e:
            raise ConfigError(str(e)) from None
        check(0.0 <= self.muon_momentum < 1.0, f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
