"""Which samples each data-parallel rank reads, as Megatron-LM's samplers.

:class:`MegatronPretrainingSampler` (``--dataloader-type single``): samples are consumed in
order from ``consumed_samples``.  Each step of ``micro_batch_size x data_parallel_size``
consecutive samples is cut into one contiguous micro-batch per rank: rank ``r`` gets
``[start + r*mbs, start + (r+1)*mbs)``.  A global batch of ``G`` samples is therefore always
samples ``[k*G, (k+1)*G)`` whatever the data-parallel size, and resuming from
``consumed_samples`` continues exactly where training stopped.

:class:`MegatronPretrainingRandomSampler` (``--dataloader-type cyclic``): epochs of shuffled
samples, each a deterministic permutation; see its docstring.
"""

from __future__ import annotations

from typing import Iterator, List

import torch

from megalm.data.indexed_dataset import DataError


class MegatronPretrainingSampler:
    """Batch sampler yielding this rank's micro-batches (lists of sample indices)."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise DataError(f"no samples to consume: total_samples = {total_samples}")
        if not 0 <= consumed_samples <= total_samples:
            raise DataError(f"consumed_samples {consumed_samples} is outside [0, total_samples {total_samples}]")
        _check_micro_batch_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
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


class MegatronPretrainingRandomSampler:
    """Batch sampler yielding this rank's micro-batches of one shuffled epoch, as Megatron-LM's.

    With ``step = micro_batch_size x data_parallel_size`` (``mbs x dp``), an epoch is
    ``E = total_samples - total_samples % step`` samples (the last incomplete step is
    dropped) and ``consumed_samples = c`` means epoch ``e = c // E``, offset ``o = c % E``
    inside it (``o`` must be a multiple of ``step``).  The epoch's permutation ``perm_e`` is
    ``torch.randperm`` with a generator seeded by ``(e + seed * 0x9E3779B9) mod 2**32`` (torch's
    CPU generator keeps 32 bits of its seed): epochs of one seed never share a permutation, and
    two seeds in ``[0, 2**16)`` do not in any of their first 50,000 epochs.

    * ``data_sharding`` (Megatron's default): rank ``r`` owns the contiguous bucket
      ``[r*B, (r+1)*B)`` with ``B = E / dp``, and reads ``r*B + perm_e(B)[o/dp:]``: every
      rank shuffles its own bucket (samples ``>= dp*B`` are never read).
    * without: ``perm_e`` permutes ``(total // mbs) * mbs`` samples, the epoch keeps its first
      ``E``, and rank ``r`` reads every ``dp``-th of them from ``o + r``; the ranks' samples of
      the step at ``o`` are then ``perm_e[o : o + step]``.

    Each call of ``iter()`` yields the rest of the current epoch in micro-batches of ``mbs``
    and advances ``consumed_samples`` by ``step`` per micro-batch, so iterating again (a
    cyclic iterator) goes on with the next epoch, and a sampler built with the saved
    ``consumed_samples`` continues exactly the same sequence.

    Differences from Megatron: the generator's seed includes ``seed`` (the run's ``--seed``),
    so different seeds shuffle differently; ``seed = 0`` gives Megatron's permutations
    (seeded by the epoch alone).  Without data sharding Megatron reads the permutation to
    its end, past ``E``, so ranks can read different numbers of micro-batches (total 14,
    mbs 2, dp 4: rank 0 two, rank 3 one) and an epoch can be longer than ``consumed_samples``
    assumes; here every rank stops at ``E``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
        seed: int = 0,
    ):
        _check_random_sampler_args(
            total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
        )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.seed = seed
        self.step = micro_batch_size * data_parallel_size
        self.epoch_samples = total_samples - total_samples % self.step

    def epoch_and_offset(self) -> tuple:
        """``(consumed // E, consumed % E)``: the current epoch and the samples consumed in it."""
        return divmod(self.consumed_samples, self.epoch_samples)

    def __len__(self) -> int:
        """Micro-batches left in the current epoch on this rank: ``(E - o) / step``."""
        return (self.epoch_samples - self.epoch_and_offset()[1]) // self.step

    def rank_epoch_order(self, epoch: int) -> torch.Tensor:
        """The ``E / dp`` sample indices this rank reads in ``epoch``, in order."""
        generator = torch.Generator().manual_seed(epoch_generator_seed(self.seed, epoch))
        dp, rank = self.data_parallel_size, self.data_parallel_rank
        if self.data_sharding:
            bucket = self.epoch_samples // dp
            return rank * bucket + torch.randperm(bucket, generator=generator)
        permuted = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
        return torch.randperm(permuted, generator=generator)[: self.epoch_samples][rank::dp]

    def __iter__(self) -> Iterator[List[int]]:
        epoch, offset = self.epoch_and_offset()
        order = self.rank_epoch_order(epoch)
        mbs = self.micro_batch_size
        for start in range(offset // self.data_parallel_size, len(order), mbs):
            self.consumed_samples += self.step
            yield order[start : start + mbs].tolist()


def epoch_generator_seed(seed: int, epoch: int) -> int:
    """``(epoch + seed * 0x9E3779B9) mod 2**32``: ``epoch`` itself for ``seed = 0`` (Megatron's).

    The multiplier is 2**32 over the golden ratio, whose multiples stay far apart modulo 2**32:
    for ``0 < |s1 - s2| < 2**16`` they differ by at least 52,777.
    """
    return (epoch + seed * 0x9E3779B9) % 2**32


def _check_random_sampler_args(
    total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int
) -> None:
    """ValueError naming the first bad argument of :class:`MegatronPretrainingRandomSampler`."""
    _check_micro_batch_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
    step = micro_batch_size * data_parallel_size
    if total_samples < step:
        raise DataError(
            f"total_samples {total_samples} is less than one step of micro_batch_size x "
            f"data_parallel_size = {step}: an epoch would be empty"
        )
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
    if consumed_samples % step:
        raise ValueError(
            f"consumed_samples {consumed_samples} is not a multiple of micro_batch_size x data_parallel_size = {step}"
        )


def _check_micro_batch_layout(micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int) -> None:
    """ValueError for a micro-batch size or data-parallel rank / size either sampler cannot use."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank {data_parallel_rank} is outside [0, {data_parallel_size})")


class ShareSampler:
    """Batch sampler: this replica's ``shares[rank]`` micro-batches (contiguous slots) of each
    global batch of ``micro_batch_size x sum(shares)`` samples, from ``consumed_samples`` on.
    ``shares`` and ``consumed_samples`` may be changed between iterations of the sampler."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, rank: int, shares):
        if total_samples <= 0:
            raise DataError(f"no samples to consume: total_samples = {total_samples}")
        if not 0 <= rank < len(shares) or min(shares) < 1:
            raise ValueError(f"data-parallel rank {rank} and shares {list(shares)}: every replica needs >= 1")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.rank, self.shares = micro_batch_size, rank, list(shares)

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_batch * self.shares[self.rank]

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * sum(self.shares)

    def __iter__(self) -> Iterator[List[int]]:
        mbs, g = self.micro_batch_size, self.global_batch
        offset = sum(self.shares[: self.rank]) * mbs
        start = self.consumed_samples
        while start + g <= self.total_samples:
            for j in range(self.shares[self.rank]):
                first = start + offset + j * mbs
                yield list(range(first, first + mbs))
            start += g
