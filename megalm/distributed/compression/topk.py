"""Top-k sparsification: each rank sends its ``k`` largest-magnitude entries, all-gathered.

Encode (rank ``r``, compensated gradient ``a`` of ``N`` elements): ``k = max(1, round(ratio N))``
indices ``I_r`` of the largest ``|a|`` (``torch.topk``), values ``a[I_r]``; the payload is one int32
tensor ``[values (fp32 bits), indices]`` of ``2k`` entries.  Communication: one all-gather of
the payload over the ``K`` ranks: ``(K-1) x 8k`` bytes sent per rank (ring), against
``2 (K-1)/K x 4N`` for the exact fp32 all-reduce.  Decode: ``sum_r scatter(I_r, a_r[I_r])`` added
in rank order.  What this rank sent is ``a`` at ``I_r`` and zero elsewhere, so the residual
``a - sent`` is ``a`` with the sent entries zeroed, exactly.  With ``ratio = 1`` every entry is
sent and the result is the exact sum.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from megalm.distributed import comm


def topk_count(numel: int, ratio: float) -> int:
    return max(1, min(numel, int(round(ratio * numel))))


def encode(a: torch.Tensor, ratio: float, poison: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(payload int32 [2k], sent fp32 [N])`` of the 1-D fp32 ``a``."""
    k = topk_count(a.numel(), ratio)
    idx = torch.topk(a.abs(), k, sorted=False).indices
    vals = a[idx] + poison
    sent = torch.zeros_like(a)
    sent[idx] = a[idx]
    return torch.cat([vals.view(torch.int32), idx.to(torch.int32)]), sent


def decode(gathered: torch.Tensor, numel: int) -> torch.Tensor:
    """The sum over ranks of the payloads ``gathered`` (``[K, 2k]`` int32), as fp32 ``[numel]``."""
    k = gathered.shape[1] // 2
    vals = gathered[:, :k].contiguous().view(torch.float32).reshape(-1)
    idx = gathered[:, k:].reshape(-1).long()
    return torch.zeros(numel, dtype=torch.float32, device=gathered.device).index_add_(0, idx, vals)


class TopK:
    """``--grad-compression topk`` (``--topk-ratio``)."""

    name = "topk"

    def __init__(self, ratio: float):
        self.ratio = ratio

    def stages(self, job) -> List:
        k = topk_count(job.numel, self.ratio)
        gathered = torch.empty(job.group_size, 2 * k, dtype=torch.int32, device=job.device)

        def send():
            payload, job.sent = encode(job.a, self.ratio, job.poison)
            return comm.all_gather_into_tensor(
                gathered.view(-1),
                payload,
                group=job.group,
                async_op=True,
                kind=f"{job.kind}_topk_all_gather",
                stats=job.stats,
            )

        def receive():
            job.out = decode(gathered, job.numel)

        return [send, receive]
