"""All-gather attention (``--cp-comm-type allgather``): K/V gathered over the context-parallel group.

Each of ``CP`` ranks all-gathers ``[2c, b, g, d]`` keys and values (only the KV heads) into
the full ``[s, b, g, d]`` (rank order, put in sequence order by :func:`.chunks.gathered_to_global`),
then runs its two query chunks against the keys they may see: chunk ``j`` (positions
``[jc, (j+1)c)``) against keys ``[0, (j+1)c)`` with the causal mask aligned to its end.  K/V
memory per rank is ``O(s)``.

Communication, forward: two all-gathers (``(CP-1) 2c b g d`` elements received per rank for each
of k and v); backward two reduce-scatters of the K/V gradients (every rank's queries contribute
to every key).  gpt-oss's window and sinks (``variant``) enter each chunk's SDPA as its mask and
a sink column (:mod:`megalm.transformer.attention_variants`); a window also trims the keys a chunk reads.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megalm.context_parallel.blocks import BlockDropout, local_attention
from megalm.context_parallel.chunks import chunk_ids, gathered_to_global
from megalm.context_parallel.keyed_dropout import KeyedDropout
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.mappings import gather_from_sequence_parallel_region


def _chunk_attention(q, k, v, chunk: int, gqa: bool, dropout: Optional[KeyedDropout], variant=None) -> torch.Tensor:
    """Query chunk ``chunk`` (``[b, n, c, d]``) against full-sequence ``k``/``v`` ``[b, g, s, d]``;
    ``variant``: gpt-oss's ``(window, sinks)`` or None."""
    c = q.shape[2]
    end = (chunk + 1) * c
    if variant is not None:
        from megalm.transformer.attention_variants import variant_attention  # (megalm.transformer imports this)

        window, sinks = variant
        start = 0 if window is None else max(0, chunk * c - window)  # keys before it are outside every window
        k, v = k[:, :, start:end], v[:, :, start:end]
        return variant_attention(q, k, v, window, sinks, query_offset=chunk * c - start)
    if dropout is not None:
        keys = torch.arange(end, device=q.device)
        block = BlockDropout(dropout, keys[chunk * c :], keys)
        return local_attention(q, k[:, :, :end], v[:, :, :end], diagonal=chunk * c, dropout=block)
    mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril_(end - c)  # key j <= chunk*c + i
    return F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], attn_mask=mask, enable_gqa=gqa)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    dropout: Optional[KeyedDropout] = None,
    variant=None,
) -> torch.Tensor:
    """Causal attention of ``[2c, b, n, d]`` q and ``[2c, b, g, d]`` k/v over ``group``'s sequence;
    returns ``[2c, b, n, d]``.  ``dropout``: the call's position-keyed attention dropout, or None."""
    cp, rank = group_size(group), group_rank(group)
    k, v = (gathered_to_global(gather_from_sequence_parallel_region(t, group), cp) for t in (k, v))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # heads-first
    gqa = q.shape[1] != k.shape[1]
    half = q.shape[2] // 2
    first, second = chunk_ids(rank, cp)
    outs = [
        _chunk_attention(q[:, :, :half], k, v, first, gqa, dropout, variant),
        _chunk_attention(q[:, :, half:], k, v, second, gqa, dropout, variant),
    ]
    return torch.cat(outs, dim=2).permute(2, 0, 1, 3)
