"""Global batch size and number of microbatches per iteration (with optional ramp-up)."""

from __future__ import annotations

from typing import Optional, Sequence


class MicrobatchCalculator:
    """Megatron's batch-size ramp-up: ``--rampup-batch-size start increment samples``.

    The global batch starts at ``start`` and grows by ``increment`` each time another
    ``samples / ((global - start) / increment)`` samples have been consumed, until it reaches
    ``--global-batch-size``.  Microbatches per iteration = global / (micro x DP).
    """

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup_batch_size: Optional[Sequence[int]] = None,
    ):
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.rampup = None
        if rampup_batch_size is not None:
            start, increment, ramp_samples = (int(x) for x in rampup_batch_size)
            if increment <= 0 or start <= 0 or start > global_batch_size:
                raise ValueError(
                    f"--rampup-batch-size {rampup_batch_size}: need 0 < start <= global batch and increment > 0"
                )
            if (global_batch_size - start) % increment != 0:
                raise ValueError(
                    f"--rampup-batch-size: global batch {global_batch_size} minus start {start} "
                    f"is not a multiple of the increment {increment}"
                )
            steps = (global_batch_size - start) // increment
            self.rampup = (start, increment, ramp_samples / max(steps, 1))
        self.current_global_batch_size = global_batch_size
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        if self.rampup is None:
            self.current_global_batch_size = self.global_batch_size
        else:
            start, increment, samples_per_step = self.rampup
            steps = int(consumed_samples / samples_per_step)
            size = min(self.global_batch_size, start + steps * increment)
            self.current_global_batch_size = max(self.micro_times_dp, size // self.micro_times_dp * self.micro_times_dp)

    @property
    def num_microbatches(self) -> int:
        return self.current_global_batch_size // self.micro_times_dp
