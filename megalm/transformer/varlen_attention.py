"""Causal attention within the segments of a packed sequence (THD, ``--qkv-format thd``).

For segments ``[c_i, c_{i+1})`` of the ``t = b s`` packed tokens (:mod:`megalm.transformer.packed_seq`)
the output of a query in segment ``i`` is ``softmax(q K_i^T / sqrt(d) + causal) V_i`` over that
segment's keys only: exactly the document-masked attention of ``--reset-attention-mask``, without
its ``[b, 1, s, s]`` mask and without the scores across documents (``sum_i L_i^2`` of them instead of
``b s^2``).

Two ways, each on one rank's heads (no communication):

* flash-attn's ``flash_attn_varlen_func`` on CUDA with ``--attention-backend flash`` (or ``auto`` where
  flash-attn runs): q, k, v as ``[t, heads, d]`` with ``cu_seqlens``; a sliding window is its
  ``window_size``; grouped keys/values as they are.  Softmax sinks take the loop.
* otherwise a loop over the segments running the plan's core (SDPA, blocked, unfused; windows and sinks
  included) causally on each ``[1, heads, L_i, d]`` slice; the outputs are concatenated in packed order.

Either way q, k, v are first copied to ``[t, heads, d]`` (packed order) and the output copied back to
``[s, b, heads, d]``; the loop splits the packed tensors once (the backward concatenates the segments'
gradients once, instead of adding each segment's into a zero tensor of the whole batch).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megalm.transformer.packed_seq import PackedSeqParams

# A causal core on heads-first tensors: q [1, n, L, d], k / v [1, g, L, d] -> [1, n, L, d].
Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: PackedSeqParams,
    core: Core,
    flash: Optional[Callable] = None,
    window: Optional[int] = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """``q`` ``[s, b, n, d]``, ``k`` / ``v`` ``[s, b, g, d]`` -> ``[s, b, n, d]``, attention within each
    segment of ``params``.  ``flash``: flash-attn's ``flash_attn_varlen_func`` (then ``window`` and
    ``dropout_p`` go to it; ``core`` is not used), else ``core`` runs per segment (it applies its own
    window and dropout)."""
    s, b, n, d = q.shape
    params.check(s, b)
    thd = [t.transpose(0, 1).reshape(b * s, *t.shape[2:]) for t in (q, k, v)]  # [t, heads, d], packed order
    if flash is not None:
        out = flash(
            *thd,
            params.cu_seqlens_q,
            params.cu_seqlens_kv,
            params.max_seqlen_q,
            params.max_seqlen_kv,
            dropout_p=dropout_p,
            causal=True,
            window_size=(-1, -1) if window is None else (window, 0),
        )
    else:  # split once (its backward is one concatenation), one causal core call per segment
        lengths = [end - start for start, end in params.segments()]
        segments = zip(*(torch.split(t, lengths) for t in thd))
        out = torch.cat([core(*(t.transpose(0, 1).unsqueeze(0) for t in qkv))[0].transpose(0, 1) for qkv in segments])
    return out.view(b, s, n, out.shape[-1]).transpose(0, 1)
