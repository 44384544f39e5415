"""``--step-batch-size-schedule``: the global batch size by consumed tokens, parsed here (the
configuration checks it; :class:`megalm.training.microbatches.MicrobatchCalculator` follows it)."""

from __future__ import annotations

from typing import List, Tuple

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
