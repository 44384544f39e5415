"""One entry point for the context-parallel attention core, by ``--cp-comm-type``.

Tensors are sequence-first as in the attention layer: ``q`` ``[2c, b, n, d]``, ``k``/``v``
``[2c, b, g, d]`` (this rank's two chunks, :mod:`.chunks`; ``n`` query heads, ``g`` KV groups);
the result is ``[2c, b, n, d]``: causal ``softmax(q k^T / sqrt(d)) v`` over the whole sequence of
the ``cp`` group.  The communication of each type is in its module.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from megalm.context_parallel.allgather import allgather_attention
from megalm.context_parallel.chunks import ContextParallelError
from megalm.context_parallel.keyed_dropout import KeyedDropout
from megalm.context_parallel.ring import ring_attention
from megalm.context_parallel.ulysses import ulysses_attention

COMM_TYPES = ("p2p", "a2a", "allgather")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    comm_type: str,
    causal_core: Callable,
    dropout: Optional[KeyedDropout] = None,
    variant: Optional[Tuple[Optional[int], Optional[torch.Tensor]]] = None,
    documents: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of this rank's chunks over ``group``'s sequence.

    ``causal_core`` (heads-first ``[b, n, s, d]`` q, ``[b, g, s, d]`` k/v -> ``[b, n, s, d]``) is the
    layer's local backend, used by ``a2a`` on the full sequence of its heads; ``p2p`` and
    ``allgather`` compute their masked blocks themselves.  ``dropout``: the call's position-keyed
    attention dropout (:mod:`.keyed_dropout`): every type applies the entries of the global
    positions it computes, so the result does not depend on ``CP`` or the type.  ``variant``: gpt-oss's
    ``(window, sinks)`` (:mod:`megalm.fusions.attention_variants`): ``allgather`` applies them to its
    chunks, ``a2a``'s ``causal_core`` applies them itself, ``p2p`` refuses them.  ``documents``: packed
    documents' ids ``[b, s]`` over the whole sequence: ``allgather`` and ``p2p`` mask other documents' keys per
    chunk / ring block, ``a2a`` runs megalm's tiled core with the same mask instead of ``causal_core`` (the
    layer gives a2a a packed ``causal_core`` instead, unless dropout is on)."""
    if variant is not None and comm_type == "p2p":
        raise ContextParallelError(
            "sliding-window attention / softmax sinks are not built in the ring (p2p) core: use --cp-comm-type "
            "a2a or allgather"
        )
    if comm_type == "p2p":
        heads_first = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return ring_attention(*heads_first, group, dropout=dropout, documents=documents).permute(2, 0, 1, 3)
    if comm_type == "a2a":
        return ulysses_attention(q, k, v, group, causal_core, dropout, documents)
    if comm_type == "allgather":
        return allgather_attention(q, k, v, group, dropout, variant, documents)
    raise ContextParallelError(f"--cp-comm-type must be one of {', '.join(COMM_TYPES)}, got {comm_type!r}")
