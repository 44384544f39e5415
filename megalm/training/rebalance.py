"""``--straggler-rebalance-interval N``: give a persistently slow data-parallel replica fewer
micro-batches of each global batch and the fast ones more, so that all finish their
forward-backward together; the global batch, its samples and the loss stay the same.

*Shares.*  A global batch of ``G`` samples is ``M = G / micro_batch_size`` micro-batch slots.
Replica ``r`` (all ranks of data-parallel rank ``r``: its TP/PP/CP ranks) reads ``n_r`` of them, the
contiguous slots ``[o_r, o_r + n_r)`` with ``o_r = n_0 + ... + n_{r-1}`` and ``sum n_r = M``
(:class:`megalm.data.samplers.ShareSampler`).  Global batch ``k`` is always samples ``[k G, (k+1) G)``, whatever the
shares, so resuming from ``consumed_samples`` is exact and the shares need not be saved.

*Loss.*  The run must use ``--calculate-per-token-loss``: each rank back-propagates the sum of
its tokens' losses and the trainer divides the reduced gradients by the global token count
(:func:`megalm.training.step.scale_gradients_by_token_count`), so the gradient is that of the
mean over every token of the global batch however the micro-batches are split (equal to the
balanced split up to floating-point summation order).  The mean of per-micro-batch means would
weight a replica's micro-batches by ``1 / n_r`` instead.

*Measuring.*  Each rank times its forward-backward (after a device synchronization) and counts
its micro-batches (not in the run's first step: one-time costs).  Every ``N`` iterations one
all-reduce (MAX, over the world) of a vector with one slot per data-parallel rank gives every
rank the same seconds per micro-batch of each replica (its slowest rank), averaged with the
previous windows (weights 1/2, 1/4, ...), and :func:`plan_shares` splits the ``M`` slots so that the
slowest replica finishes first (at least one each).  The new shares apply from the next
iteration; the reading ranks re-start their train iterator at the current ``consumed_samples``
(prefetched batches of the old split are dropped).  A new split is taken only when it predicts a
forward-backward at least 5% shorter (``max_r n_r t_r``), so timing noise does not make the split flap.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megalm.device import get_device, synchronize
from megalm.log import get_logger

logger = get_logger(__name__)


def plan_shares(seconds_per_microbatch: Sequence[float], total: int) -> List[int]:
    """``total`` micro-batches split so that the slowest replica finishes first: the shares minimizing
    ``max_r n_r t_r`` (each replica at least one).  Greedy, which is optimal for equal micro-batches:
    each slot after the first of each goes to the replica that would finish it soonest (ties to the
    lower rank).  Splitting in proportion to speed and rounding is not: at ``t = [4.2, 11.6]`` ms and 8
    micro-batches it gives ``[5, 3]`` (34.8 ms), this ``[6, 2]`` (25.2 ms).  Non-positive times
    (nothing measured) count as the fastest measured one."""
    n = len(seconds_per_microbatch)
    if total < n:
        raise ValueError(f"{total} micro-batches cannot give each of {n} data-parallel replicas one")
    measured = [s for s in seconds_per_microbatch if s > 0]
    fastest = min(measured) if measured else 1.0
    times = [s if s > 0 else fastest for s in seconds_per_microbatch]
    shares = [1] * n
    for _ in range(total - n):
        r = min(range(n), key=lambda i: ((shares[i] + 1) * times[i], i))
        shares[r] += 1
    return shares


class StragglerRebalancer:
    """Shares of the data-parallel replicas, the timing window, and the collective that re-plans."""

    def __init__(self, interval: int, num_microbatches: int, dp_rank: int, dp_size: int):
        self.interval, self.dp_rank, self.dp_size = interval, dp_rank, dp_size
        self.total = num_microbatches * dp_size
        self.shares = [num_microbatches] * dp_size
        self._seconds, self._microbatches = 0.0, 0
        self.seconds: Optional[List[float]] = None  # per replica, averaged over windows
        self._warm = False  # the first step (allocations, first-call costs) is not timed

    @property
    def local_microbatches(self) -> int:
        return self.shares[self.dp_rank]

    def timed(self, run):
        """``run()`` timed (device synchronized after it) into the window; returns its result."""
        start = time.perf_counter()
        out = run()
        synchronize()
        if not self._warm:
            self._warm = True
            return out
        self._seconds += time.perf_counter() - start
        self._microbatches += self.local_microbatches
        return out

    def replan(self) -> Optional[List[int]]:
        """Collective over the world (one all-reduce): new shares from the window, or None when they
        do not change.  Resets the window."""
        per = torch.zeros(self.dp_size, dtype=torch.float64, device=get_device())
        if self._microbatches:
            per[self.dp_rank] = self._seconds / self._microbatches
        if dist.is_initialized():
            dist.all_reduce(per, op=dist.ReduceOp.MAX)
        self._seconds, self._microbatches = 0.0, 0
        window = per.tolist()
        if self.seconds is None:
            self.seconds = window
        else:  # half the weight to the new window: one noisy window does not move the split back and forth
            self.seconds = [
                w if old <= 0 else (old if w <= 0 else 0.5 * (old + w)) for old, w in zip(self.seconds, window)
            ]
        seconds = self.seconds
        shares = plan_shares(seconds, self.total)
        if max(n * t for n, t in zip(shares, seconds)) > 0.95 * max(n * t for n, t in zip(self.shares, seconds)):
            return None  # under 5% predicted gain: keep the split (timing noise would make it flap)
        logger.info(
            f"straggler rebalance: micro-batches per data-parallel rank {self.shares} -> {shares} "
            f"(seconds per micro-batch {[round(s, 4) for s in seconds]})"
        )
        self.shares = shares
        return shares
