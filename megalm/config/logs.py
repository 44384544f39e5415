"""``LoggingConfig``: console, metrics file, TensorBoard, W&B, timers, stragglers and profiling,
and the checks between its flags (the profiled ranks against the world size, when known)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megalm.config.fields import Section, check
from megalm.config.fields import flag_field as _f
from megalm.device import use_cuda


@dataclass
class LoggingConfig(Section):
    """Console, metrics file, TensorBoard and Weights & Biases."""

    log_interval: int = _f(100, "Print a log line every this many iterations.")
    logging_level: Optional[int] = _f(
        None, "Level of megalm's log (Python logging: 10 debug, 20 info, 30 warning); default info."
    )
    log_params_norm: bool = _f(False, "Log the L2 norm of the parameters (each distinct parameter counted once).")
    metrics_file: Optional[str] = _f(
        None, "Append JSON Lines metrics here (one record per logged iteration and evaluation)."
    )
    tensorboard_dir: Optional[str] = _f(None, "Write TensorBoard scalars here.")
    tensorboard_log_interval: Optional[int] = _f(
        None,
        "Also write this iteration's loss, learning rate, loss scale, grad norm and batch size to TensorBoard "
        "and W&B every this many iterations (as Megatron; default: with each log line only).",
    )
    wandb_project: Optional[str] = _f(None, "Weights & Biases project (enables W&B logging).")
    wandb_exp_name: Optional[str] = _f(None, "Weights & Biases run name.")
    wandb_save_dir: Optional[str] = _f(None, "Weights & Biases local directory.")
    device_peak_flops: Optional[float] = _f(
        None, "Peak FLOP/s per device for MFU (default: table, or measured on CPU)."
    )
    log_memory: bool = _f(True, "Disable the peak-memory report.", flag="--no-log-memory", action="store_false")
    log_throughput: bool = _f(
        False,
        "Accepted for Megatron-LM scripts (warns): megalm always logs tokens per second, TFLOP/s per rank and MFU.",
    )
    timing_log_level: int = _f(
        0,
        "Per-phase timers in the log: 0 set-up and checkpoint saving, 1 adds forward-backward, "
        "gradient sync and optimizer steps, 2 adds compute, data and pipeline exchanges "
        "(see megalm/timers.py).",
        choices=[0, 1, 2],
    )
    timing_log_option: str = _f(
        "minmax", "Timer values shown across ranks: max, minmax or all.", choices=["max", "minmax", "all"]
    )
    log_memory_to_tensorboard: bool = _f(
        False,
        "Also write this rank's memory (CUDA: mem-reserved-bytes, "
        "mem-allocated-bytes, mem-max-allocated-bytes, mem-allocated-count; "
        "CPU: mem-max-rss-bytes) to TensorBoard, W&B and the metrics file.",
    )
    log_world_size_to_tensorboard: bool = _f(False, "Also write world-size to TensorBoard, W&B and the metrics file.")
    log_validation_ppl_to_tensorboard: bool = _f(
        False, "Accepted for Megatron-LM scripts (warns): validation perplexity is always logged (lm loss <split> ppl)."
    )
    log_timers_to_tensorboard: bool = _f(
        False,
        "Also write the timers (slowest rank, seconds per iteration) to "
        "TensorBoard, W&B and the metrics file as <name>-time.",
    )
    barrier_with_level_1_timing: bool = _f(
        True,
        "Do not start level-1 timers with a barrier over all ranks.",
        flag="--no-barrier-with-level-1-timing",
        action="store_false",
    )
    log_straggler: bool = _f(
        False,
        "Each log interval, name the slowest and fastest ranks by step time and by compute time "
        "(forward and backward steps), with host and node, on the log line and in the metrics file "
        "(megalm/training/stragglers.py).",
    )
    straggler_minmax_count: int = _f(1, "With --log-straggler: how many slowest and fastest ranks to name.")
    disable_straggler_on_startup: bool = _f(
        False,
        "With --log-straggler: start with the report off; each connection to --straggler-ctrlr-port "
        "on rank 0 toggles it.",
    )
    straggler_ctrlr_port: int = _f(
        65535, "With --log-straggler: rank 0's TCP port whose connections toggle the report (0: any free port)."
    )
    profile: bool = _f(
        False,
        "Profile iterations --profile-step-start to --profile-step-end on --profile-ranks: "
        "with --use-pytorch-profiler a torch.profiler trace in --tensorboard-dir, else "
        "cudaProfilerStart/Stop and NVTX ranges for nsys (CUDA).",
    )
    use_pytorch_profiler: bool = _f(False, "With --profile: use torch.profiler (CPU and CUDA activities).")
    profile_step_start: int = _f(10, "First profiled iteration (the step that starts after this many iterations).")
    profile_step_end: int = _f(12, "Profiling stops after this many iterations.")
    profile_ranks: List[int] = _f([0], "Global ranks to profile.", nargs="+")

    def validate(self, world_size: Optional[int] = None) -> None:
        check(self.log_interval > 0, "--log-interval must be positive")
        check(
            self.tensorboard_log_interval is None or self.tensorboard_log_interval > 0,
            "--tensorboard-log-interval must be positive",
        )
        check(
            self.straggler_minmax_count > 0,
            f"--straggler-minmax-count must be positive, got {self.straggler_minmax_count}",
        )
        port = self.straggler_ctrlr_port
        check(0 <= port <= 65535, f"--straggler-ctrlr-port must be a TCP port (0-65535), got {port}")
        self._validate_profiling(world_size)

    def _validate_profiling(self, world_size: Optional[int]) -> None:
        if self.use_pytorch_profiler:
            check(self.profile, "--use-pytorch-profiler needs --profile")
            check(
                self.tensorboard_dir is not None,
                "--use-pytorch-profiler writes its trace to --tensorboard-dir: give one",
            )
        if not self.profile:
            return
        check(
            0 <= self.profile_step_start < self.profile_step_end,
            f"--profile-step-start {self.profile_step_start} must be >= 0 and before --profile-step-end "
            f"{self.profile_step_end}",
        )
        bad = [r for r in self.profile_ranks if r < 0 or (world_size is not None and r >= world_size)]
        check(
            not bad and self.profile_ranks,
            f"--profile-ranks {bad or self.profile_ranks} must be ranks of the world (size {world_size})",
        )
        check(
            self.use_pytorch_profiler or use_cuda(),
            "--profile without --use-pytorch-profiler drives nsys through CUDA and this machine has no GPU: "
            "add --use-pytorch-profiler (and --tensorboard-dir)",
        )
