"""The load-balanced sequence split: which positions each context-parallel rank holds.

The sequence of ``s`` positions is cut into ``2 CP`` chunks of ``c = s / (2 CP)``; rank ``i``
holds chunks ``i`` and ``2 CP - 1 - i``, concatenated in that order (so its local order is the
global order).  Under the causal mask chunk ``j`` attends to ``(j + 1/2) c`` keys on average, so
each rank's pair does ``(2 CP) c`` of them: the same work on every rank.  No communication.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megalm.errors import MegalmError
from megalm.parallel_state import group_rank, group_size


class ContextParallelError(MegalmError, ValueError):
    """A shape or layout the context-parallel split cannot take."""


def chunk_ids(cp_rank: int, cp: int) -> Tuple[int, int]:
    """The two global chunk indices rank ``cp_rank`` of ``cp`` holds."""
    return cp_rank, 2 * cp - 1 - cp_rank


def chunk_size(seq: int, cp: int) -> int:
    if seq % (2 * cp):
        raise ContextParallelError(f"sequence length {seq} must be divisible by 2 x --context-parallel-size ({2 * cp})")
    return seq // (2 * cp)


def local_positions(seq: int, cp_rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions (int64, ``[s / cp]``) of the tokens rank ``cp_rank`` holds, in local order."""
    c = chunk_size(seq, cp)
    return torch.cat([torch.arange(j * c, (j + 1) * c, device=device) for j in chunk_ids(cp_rank, cp)])


def split_sequence(t: torch.Tensor, dim: int, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (the full sequence), concatenated."""
    if cp == 1:
        return t
    c = chunk_size(t.shape[dim], cp)
    return torch.cat([t.narrow(dim, j * c, c) for j in chunk_ids(cp_rank, cp)], dim=dim)


def get_batch_on_this_cp_rank(batch: Dict[str, Optional[torch.Tensor]], cp_group) -> Dict[str, Optional[torch.Tensor]]:
    """This rank's two chunks of each ``[b, s]`` tensor of ``batch`` over ``cp_group`` (the batch itself at
    CP 1; None values stay None).  Megatron's ``get_batch_on_this_cp_rank``; the position ids split
    with the rest are the chunks' global positions."""
    cp = group_size(cp_group)
    if cp == 1:
        return batch
    rank = group_rank(cp_group)
    return {k: None if t is None else split_sequence(t, 1, rank, cp) for k, t in batch.items()}


def gathered_order(cp: int) -> torch.Tensor:
    """Global chunk index of each chunk of a rank-ordered gather (``rank 0's two, rank 1's two, ...``)."""
    return torch.tensor([j for r in range(cp) for j in chunk_ids(r, cp)])


def gathered_to_global(t: torch.Tensor, cp: int) -> torch.Tensor:
    """Reorder a rank-ordered gather along dim 0 into global sequence order."""
    c = t.shape[0] // (2 * cp)
    inverse = torch.argsort(gathered_order(cp))
    return t.view(2 * cp, c, *t.shape[1:])[inverse.to(t.device)].reshape(t.shape)


def global_to_gathered(t: torch.Tensor, cp: int) -> torch.Tensor:
    """Inverse of :func:`gathered_to_global`."""
    c = t.shape[0] // (2 * cp)
    return t.view(2 * cp, c, *t.shape[1:])[gathered_order(cp).to(t.device)].reshape(t.shape)
