"""Ulysses attention (``--cp-comm-type a2a``): all-to-all from sequence- to head-sharded and back.

Each of ``CP`` ranks holds ``[2c, b, n, d]`` (its two chunks, all its heads).  An all-to-all
sends head slice ``j`` (``n / CP`` heads) of its tokens to rank ``j``, which then holds every
token of ``n / CP`` heads, in rank order (:func:`.chunks.gathered_to_global` puts it in
sequence order), runs the ordinary causal core on them and sends the result back by the
inverse all-to-all.  Query head ``h`` uses KV group ``h // (n / g)``, so slicing ``n`` query
heads and ``g`` KV heads into ``CP`` equal parts keeps each rank's queries with their groups:
both must be divisible by ``CP``.  With attention dropout (:mod:`.keyed_dropout`) the core is
:func:`.blocks.local_attention` with the mask of this rank's heads (head offset ``rank n / CP``).

Communication, forward: three all-to-alls in (q, k, v: ``(CP-1)/CP`` of ``2c b (n + 2g) d``
elements sent per rank) and one out (``(CP-1)/CP`` of ``2c b n d``); backward the same volumes
in the opposite directions.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megalm.context_parallel.blocks import BlockDocuments, BlockDropout, local_attention
from megalm.context_parallel.chunks import ContextParallelError, gathered_to_global, global_to_gathered
from megalm.context_parallel.keyed_dropout import KeyedDropout
from megalm.parallel_state import group_rank, group_size


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[s/CP, b, n, d]`` -> ``[s, b, n/CP, d]`` (rank-ordered sequence)."""
    cp = group_size(group)
    s, b, n, d = x.shape
    pieces = x.view(s, b, cp, n // cp, d).permute(2, 0, 1, 3, 4)  # [cp (head slice), s/cp, b, n/cp, d]
    return _all_to_all(pieces, group).view(cp * s, b, n // cp, d)


def _heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """``[s, b, n/CP, d]`` (rank-ordered sequence) -> ``[s/CP, b, n, d]``."""
    cp = group_size(group)
    s, b, n, d = x.shape
    pieces = _all_to_all(x.view(cp, s // cp, b, n, d), group)  # [cp (head slice), s/cp, b, n/cp, d]
    return pieces.permute(1, 2, 0, 3, 4).reshape(s // cp, b, cp * n, d)


class _SeqToHeads(torch.autograd.Function):
    """Forward :func:`_seq_to_heads`; backward its inverse on the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """Forward :func:`_heads_to_seq`; backward its inverse on the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def check_heads(num_heads: int, num_groups: int, cp: int) -> None:
    if num_heads % cp or num_groups % cp:
        raise ContextParallelError(
            f"--cp-comm-type a2a needs the attention heads ({num_heads}) and KV groups ({num_groups}) per "
            f"tensor-parallel rank divisible by --context-parallel-size ({cp})"
        )


def _keyed_core(dropout: Optional[KeyedDropout], head_offset: int, documents: Optional[torch.Tensor]) -> Callable:
    """Causal :func:`.blocks.local_attention` with ``dropout``'s mask from head ``head_offset`` on (None: no
    dropout) and, with ``documents`` (``[b, s]`` ids), each query seeing only keys of its document."""
    docs = None if documents is None else BlockDocuments(documents, documents)

    def core(q, k, v):
        positions = torch.arange(q.shape[2], device=q.device)
        block = None if dropout is None else BlockDropout(dropout.heads_from(head_offset), positions, positions)
        return local_attention(q, k, v, dropout=block, documents=docs)

    return core


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    causal_core: Callable,
    dropout: Optional[KeyedDropout] = None,
    documents: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of ``[2c, b, n, d]`` q and ``[2c, b, g, d]`` k/v over ``group``'s sequence.

    ``causal_core``: heads-first ``[b, n', s, d]`` q and ``[b, g', s, d]`` k/v -> ``[b, n', s, d]``
    (the layer's local backend), replaced by megalm's tiled core when ``dropout`` (position-keyed) or
    ``documents`` (packed documents' ids ``[b, s]`` over the whole sequence) is given.
    Returns ``[2c, b, n, d]``."""
    cp = group_size(group)
    check_heads(q.shape[2], k.shape[2], cp)
    if dropout is not None or documents is not None:
        causal_core = _keyed_core(dropout, group_rank(group) * (q.shape[2] // cp), documents)
    q, k, v = (gathered_to_global(_SeqToHeads.apply(t, group), cp) for t in (q, k, v))
    out = causal_core(*(t.permute(1, 2, 0, 3) for t in (q, k, v))).permute(2, 0, 1, 3)
    return _HeadsToSeq.apply(global_to_gathered(out, cp), group)
