"""Global batch size and number of microbatches per iteration: constant, Megatron's linear ramp-up
(``--rampup-batch-size``) or Megatron's step schedule (``--step-batch-size-schedule``).

The batch of an iteration is decided from the samples consumed before it (``update``), so the
accounting is exact across changes and resume: the checkpoint's ``consumed_train_samples`` alone
determines every later batch.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from megalm.errors import MegalmError

SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class ScheduleError(MegalmError, ValueError):
    """A ``--step-batch-size-schedule`` string that does not parse or is not increasing from 0, or a
    ``--rampup-batch-size`` that does not reach the global batch size."""


def _tokens(text: str) -> int:
    """``"2.4B"`` -> 2_400_000_000 (suffixes K, M, B, T: 1e3 .. 1e12); plain integers as they are."""
    scale = SUFFIXES.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale if scale != 1 else int(number)
    except ValueError:
        raise ScheduleError(f"threshold {text!r} is not a number with an optional K/M/B/T suffix") from None
    return int(round(value))


def parse_step_batch_size_schedule(text: str, seq_length: int) -> List[Tuple[int, int]]:
    """``"0:16 2.4B:320"`` -> ``[(0, 16), (2_400_000_000 // seq_length, 320)]``: (threshold in samples,
    global batch) pairs.  Thresholds are tokens (Megatron's), converted to samples by floor division
    by ``seq_length``; the first must be 0 and the sample thresholds strictly increasing."""
    pairs, tokens = [], []
    for item in text.split():
        threshold, sep, batch = item.partition(":")
        if not sep or not batch.isdigit() or int(batch) <= 0:
            raise ScheduleError(f"entry {item!r} is not <tokens>:<global batch size> with a batch size > 0")
        tokens.append(_tokens(threshold))
        pairs.append((tokens[-1] // seq_length, int(batch)))
    if not pairs or tokens[0] != 0:
        raise ScheduleError(f"{text!r}: the first threshold must be 0")
    if any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:])):
        raise ScheduleError(f"{text!r}: thresholds (in samples of --seq-length {seq_length}) must increase")
    return pairs


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
