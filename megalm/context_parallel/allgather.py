"""All-gather attention (``--cp-comm-type allgather``): K/V gathered over the context-parallel group.

Each of ``CP`` ranks all-gathers ``[2c, b, g, d]`` keys and values (only the KV heads) into
the full ``[s, b, g, d]`` (rank order, put in sequence order by :func:`.chunks.gathered_to_global`),
then runs its two query chunks against the keys they may see: chunk ``j`` (positions
``[jc, (j+1)c)``) against keys ``[0, (j+1)c)`` with the causal mask aligned to its end.  K/V
memory per rank is ``O(s)``.

Communication, forward: two all-gathers (``(CP-1) 2c b g d`` elements received per rank for each
of k and v); backward two reduce-scatters of the K/V gradients (every rank's queries contribute
to every key).  gpt-oss's window and sinks (``variant``) enter each chunk's SDPA as its mask and
a sink column (:mod:`megalm.fusions.attention_variants`); a window also trims the keys a chunk reads.

Packed documents (``--qkv-format thd``, ``documents``: every position's document id ``[b, s]``): each
query chunk also masks keys of other documents, a boolean ``[b, 1, c, (j+1)c]`` per chunk (``O(c s)``,
not the dense ``s x s``; with attention dropout the tiled core's per-tile mask instead).  The sequence
keeps the load-balanced split of :mod:`.chunks`, not Megatron's per-document ``2 x CP`` split: the same
results, less even work when documents are short.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megalm.context_parallel.blocks import BlockDocuments, BlockDropout, local_attention
from megalm.context_parallel.chunks import chunk_ids, gathered_to_global
from megalm.context_parallel.keyed_dropout import KeyedDropout
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.mappings import gather_from_sequence_parallel_region


def _chunk_attention(
    q, k, v, chunk: int, gqa: bool, dropout: Optional[KeyedDropout], variant=None, documents=None
) -> torch.Tensor:
    """Query chunk ``chunk`` (``[b, n, c, d]``) against full-sequence ``k``/``v`` ``[b, g, s, d]``;
    ``variant``: gpt-oss's ``(window, sinks)`` or None; ``documents``: ``[b, s]`` document ids or None."""
    c = q.shape[2]
    end = (chunk + 1) * c
    doc_mask = None
    if documents is not None:  # [b, 1, c, end]: same document (the causal part is added below)
        doc_mask = (documents[:, chunk * c : end, None] == documents[:, None, :end]).unsqueeze(1)
    if variant is not None:
        from megalm.fusions.attention_variants import variant_attention

        window, sinks = variant
        start = 0 if window is None else max(0, chunk * c - window)  # keys before it are outside every window
        k, v = k[:, :, start:end], v[:, :, start:end]
        doc_mask = None if doc_mask is None else doc_mask[..., start:]
        return variant_attention(q, k, v, window, sinks, doc_mask=doc_mask, query_offset=chunk * c - start)
    if dropout is not None:
        keys = torch.arange(end, device=q.device)
        block = BlockDropout(dropout, keys[chunk * c :], keys)
        docs = None if documents is None else BlockDocuments(documents[:, chunk * c : end], documents[:, :end])
        return local_attention(q, k[:, :, :end], v[:, :, :end], diagonal=chunk * c, dropout=block, documents=docs)
    mask = torch.ones(c, end, dtype=torch.bool, device=q.device).tril_(end - c)  # key j <= chunk*c + i
    if doc_mask is not None:
        mask = mask & doc_mask
    return F.scaled_dot_product_attention(q, k[:, :, :end], v[:, :, :end], attn_mask=mask, enable_gqa=gqa)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    dropout: Optional[KeyedDropout] = None,
    variant=None,
    documents: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of ``[2c, b, n, d]`` q and ``[2c, b, g, d]`` k/v over ``group``'s sequence;
    returns ``[2c, b, n, d]``.  ``dropout``: the call's position-keyed attention dropout, or None;
    ``documents``: the whole sequence's document ids ``[b, s]`` (packed documents), or None."""
    cp, rank = group_size(group), group_rank(group)
    k, v = (gathered_to_global(gather_from_sequence_parallel_region(t, group), cp) for t in (k, v))
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # heads-first
    gqa = q.shape[1] != k.shape[1]
    half = q.shape[2] // 2
    first, second = chunk_ids(rank, cp)
    outs = [
        _chunk_attention(q[:, :, :half], k, v, first, gqa, dropout, variant, documents),
        _chunk_attention(q[:, :, half:], k, v, second, gqa, dropout, variant, documents),
    ]
    return torch.cat(outs, dim=2).permute(2, 0, 1, 3)
