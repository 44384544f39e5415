"""Sliding-window attention and softmax sinks (gpt-oss) for the SDPA and unfused cores.

Per head ``h``, query at global position ``i`` and key at ``j``, with ``S = scale q k^T``::

    allowed(i, j) = j <= i  and  (window is None or j >= i - window)  [and the document mask]
    P(i, j) = exp(S_ij) / (exp(sink_h) + sum_{allowed j'} exp(S_ij'))        (sink_h: a logit, no value)

``--softmax-type off-by-one`` is ``sink_h = 0``; ``learnable`` a learned per-head logit; vanilla has no
sink term.  The sink adds nothing to the output (it has no value vector); it only takes probability
mass, so a head can attend to "nothing".

SDPA computes ``softmax(S + M) V`` with an additive mask ``M``; a sink is one more key column whose key
and value are zero and whose additive mask entry is ``sink_h`` (its score ``q . 0 = 0``): exactly the
formula above, and the sink's gradient is the sum of that column's mask gradient.  The float mask is
``[b, n, s_q, s_k + 1]``: this path keeps an ``s x s`` mask like the unfused core (the blocked CPU core,
:mod:`megalm.transformer.blocked_attention`, computes windows and sinks per block without one).
No communication.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def allowed_positions(query_pos: torch.Tensor, key_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """Boolean ``[s_q, s_k]``: causal, and within ``window`` keys to the left when given."""
    diff = query_pos.unsqueeze(1) - key_pos.unsqueeze(0)
    ok = diff >= 0
    return ok if window is None else ok & (diff <= window)


def variant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: Optional[int],
    sinks: Optional[torch.Tensor],
    doc_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    query_offset: int = 0,
) -> torch.Tensor:
    """SDPA on heads-first ``q`` ``[b, n, s_q, d]``, ``k``/``v`` ``[b, g, s_k, d]`` (``n`` a multiple of
    ``g``) with a sliding ``window`` and per-head ``sinks`` ``[n]`` (either may be None).  Query row ``r``
    sits at position ``query_offset + r``, keys at ``0..s_k-1``.  ``doc_mask``: boolean ``[b, 1, s_q, s_k]``
    (True where allowed, already causal), combined with the window."""
    sq, sk = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    qpos = torch.arange(query_offset, query_offset + sq, device=q.device)
    allowed = allowed_positions(qpos, torch.arange(sk, device=q.device), window)
    if doc_mask is not None:
        allowed = allowed & doc_mask
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, allowed, dropout_p=dropout_p, enable_gqa=gqa)
    b, n = q.shape[:2]
    zeros = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    bias = bias.expand(b, n, sq, sk)  # [s_q, s_k] or [b, 1, s_q, s_k]
    sink_col = sinks.to(q.dtype).view(1, n, 1, 1).expand(b, n, sq, 1)
    return F.scaled_dot_product_attention(
        q, k, v, torch.cat([bias, sink_col], dim=-1), dropout_p=dropout_p, enable_gqa=gqa
    )
