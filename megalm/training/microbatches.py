"""Global batch size and number of microbatches per iteration: constant, Megatron's linear ramp-up
(``--rampup-batch-size``) or Megatron's step schedule (``--step-batch-size-schedule``).

The batch of an iteration is decided from the samples consumed before it (``update``), so the
accounting is exact across changes and resume: the checkpoint's ``consumed_train_samples`` alone
determines every later batch.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from megalm.config.batch_schedule import ScheduleError, parse_step_batch_size_schedule  # noqa: F401 (re-exported)


class MicrobatchCalculator:
    """Megatron's batch-size ramp-up: ``--rampup-batch-size start increment samples``, or its step
    schedule: ``step_schedule`` (from :func:`parse_step_batch_size_schedule`), the batch of the last
    threshold at or below the consumed samples.

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
        step_schedule: Optional[Sequence[Tuple[int, int]]] = None,
    ):
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.rampup = None
        if rampup_batch_size is not None:
            start, increment, ramp_samples = (int(x) for x in rampup_batch_size)
            if increment <= 0 or start <= 0 or start > global_batch_size:
                raise ScheduleError(
                    f"--rampup-batch-size {rampup_batch_size}: need 0 < start <= global batch and increment > 0"
                )
            if (global_batch_size - start) % increment != 0:
                raise ScheduleError(
                    f"--rampup-batch-size: global batch {global_batch_size} minus start {start} "
                    f"is not a multiple of the increment {increment}"
                )
            steps = (global_batch_size - start) // increment
            self.rampup = (start, increment, ramp_samples / max(steps, 1))
        self.step_schedule = list(step_schedule) if step_schedule is not None else None
        self.current_global_batch_size = global_batch_size
        self.update(0)

    def update(self, consumed_samples: int) -> None:
        """Set the batch of the next iteration from the samples consumed before it."""
        if self.step_schedule is not None:
            self.current_global_batch_size = [b for t, b in self.step_schedule if t <= consumed_samples][-1]
        elif self.rampup is None:
            self.current_global_batch_size = self.global_batch_size
        else:
            start, increment, samples_per_step = self.rampup
            steps = int(consumed_samples / samples_per_step)
            size = min(self.global_batch_size, start + steps * increment)
            self.current_global_batch_size = max(self.micro_times_dp, size // self.micro_times_dp * self.micro_times_dp)

    @property
    def num_microbatches(self) -> int:
        return self.current_global_batch_size // self.micro_times_dp
