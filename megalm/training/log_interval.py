"""Log-line bookkeeping of the training loop: the values accumulated between two log lines
(:class:`IntervalStats`) and which rank reports them.

Communication: :meth:`IntervalStats.means` is collective over the pipeline group (every stage
receives the last stage's losses, :func:`megalm.pipeline_parallel.reporting.losses_to_floats`); the other helpers
only read the layout or log.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from megalm.config import MegalmConfig
from megalm.log import get_logger
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.pipeline_parallel.reporting import losses_to_floats
from megalm.training.step import StepResult

logger = get_logger(__name__)


def log_rank_last(message: str) -> None:
    """Megatron's ``print_rank_last``: INFO shown on the world's last rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    logger.info(message, extra={"on_rank": world - 1})


def print_timing(block: Optional[str]) -> None:
    """A timing block from :meth:`megalm.timers.Timers.log`, on the last rank (as Megatron)."""
    if block is not None:
        log_rank_last(block)


def is_logging_rank(groups: ProcessGroups) -> bool:
    """The rank that reports losses: last pipeline stage, TP rank 0, CP rank 0, DP rank 0 (the world's last
    rank ... or first)."""
    return (
        group_rank(groups.pp) == group_size(groups.pp) - 1
        and group_rank(groups.tp) == 0
        and group_rank(groups.cp) == 0
        and group_rank(groups.dp) == 0
    )


class IntervalStats:
    """Accumulates per-iteration values between two log lines; losses stay on the device
    until :meth:`means` (once per log line)."""

    def __init__(self):
        self.iterations = 0
        self.time = 0.0
        self.samples = 0
        self.sums: Dict[str, torch.Tensor] = {}
        self.counts: Dict[str, int] = {}
        self.skipped = 0
        self.nans = 0
        self.last_grad_norm: Optional[float] = None
        self.last_num_zeros: Optional[float] = None

    def add(self, seconds: float, result: StepResult) -> None:
        self.iterations += 1
        self.time += seconds
        self.samples += result.global_batch_size
        self.skipped += int(result.skipped)
        self.nans += int(result.nan)
        if result.grad_norm is not None:
            self.last_grad_norm = float(result.grad_norm)
        if result.num_zeros is not None:
            self.last_num_zeros = float(result.num_zeros)
        if not result.skipped:
            for k, v in result.losses.items():
                self.sums[k] = self.sums[k] + v if k in self.sums else v
                self.counts[k] = self.counts.get(k, 0) + 1

    def means(self, groups=None) -> Dict[str, float]:
        """Mean of each loss over the interval's successful iterations, on every pipeline stage
        (collective over the pipeline group: every rank calls it)."""
        return losses_to_floats({k: v / self.counts[k] for k, v in self.sums.items()}, groups)

    def mean_time(self) -> float:
        return self.time / max(self.iterations, 1)

    def throughput(self, cfg: MegalmConfig, peak_flops: Optional[float]) -> Dict[str, Optional[float]]:
        """The log line's speed fields over the interval: tokens/s, TFLOP/s per rank, MFU, ms per iteration."""
        from megalm.flops import num_floating_point_operations

        elapsed = self.mean_time()
        samples = self.samples / max(self.iterations, 1)
        flops = num_floating_point_operations(cfg, samples)
        world = dist.get_world_size() if dist.is_initialized() else 1
        return {
            "tokens_per_sec": samples * cfg.model.seq_length / elapsed if elapsed > 0 else 0.0,
            "tflops_per_rank": flops / elapsed / world / 1e12 if elapsed > 0 else 0.0,
            "mfu": flops / elapsed / world / peak_flops if elapsed > 0 and peak_flops else None,
            "elapsed_ms": elapsed * 1000.0,
        }
