"""The language-model loss of one micro-batch under context parallelism.

Each of ``CP`` ranks holds the per-token losses ``l`` and mask ``m`` of its two chunks: local sum
``L_r = sum(l m)`` and count ``n_r = sum(m)``; the micro-batch's mean is ``L / N`` with
``L = sum_r L_r``, ``N = sum_r n_r``.  Gradients are averaged over the ``dp x cp`` ranks (the
data-parallel buffers scale by ``1 / (DP CP)``), so rank ``r`` back-propagates ``CP L_r / N``: the
CP ranks' contributions, summed and divided by ``CP``, are the gradient of ``L / N`` (Megatron's
``loss * cp_size``).  Under ``--calculate-per-token-loss`` the trainer divides the summed
gradients by the step's summed counts, which are then ``CP`` times the tokens, which the factor
``CP`` cancels as well.  The reported ``[L, N]`` is the micro-batch's, the same on every CP rank.

Communication: one all-reduce (SUM) of the two numbers ``[L_r, n_r]`` (detached) over ``cp``.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from megalm.parallel_state import group_size


def context_parallel_loss(
    loss_sum: torch.Tensor, num_tokens: torch.Tensor, cp_group
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss to back-propagate, token count, reported [L, N])`` from this rank's ``L_r`` and
    ``n_r``; at CP 1 ``(L_r, n_r, [L_r, n_r])``."""
    reported = torch.stack([loss_sum.detach(), num_tokens.detach().to(loss_sum.dtype)])
    cp = group_size(cp_group)
    if cp == 1:
        return loss_sum, num_tokens, reported
    dist.all_reduce(reported, group=cp_group)
    return loss_sum * cp, reported[1], reported
