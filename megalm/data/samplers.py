"""Which samples each data-parallel rank reads, as Megatron-LM's ``MegatronPretrainingSampler``.

Samples are consumed in order from ``consumed_samples``.  Each step of ``micro_batch_size
x data_parallel_size`` consecutive samples is cut into one contiguous micro-batch per
rank: rank ``r`` gets ``[start + r*mbs, start + (r+1)*mbs)``.  A global batch of ``G``
samples is therefore always samples ``[k*G, (k+1)*G)`` whatever the data-parallel size,
and resuming from ``consumed_samples`` continues exactly where training stopped.
"""

from __future__ import annotations

from typing import Iterator, List


class MegatronPretrainingSampler:
    """Batch sampler yielding this rank's micro-batches (lists of sample indices)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"no samples to consume: total_samples = {total_samples}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside [0, total_samples {total_samples}]")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self.step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full = remaining // self.step
        if self.drop_last or remaining % self.step == 0:
            return full
        return full + (remaining % self.step > self.data_parallel_rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[List[int]]:
        offset = self.data_parallel_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + self.step <= self.total_samples:
            yield list(range(start + offset, start + offset + self.micro_batch_size))
            start += self.step
        if not self.drop_last and start < self.total_samples:
            end = min(start + offset + self.micro_batch_size, self.total_samples)
            if start + offset < end:
                yield list(range(start + offset, end))
