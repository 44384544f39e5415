"""Scaled causal softmax of attention scores (the "masked softmax" of the unfused attention path).

``softmax(scale * scores + causal_mask)`` in fp32, cast back to the scores' dtype.  Eagerly
that is a scale, a masked fill and a softmax, with an fp32 copy when scores are bf16;
compiled it is one pass forward and one backward.  Used only when attention does not go
through SDPA / flash-attn (``--attention-backend unfused``).  :func:`masked_scaled_softmax` takes an
explicit boolean mask instead (``--reset-attention-mask``; eager).  No communication.
"""

from __future__ import annotations

import torch

from megalm.fusions.compile import fusion


@fusion("masked_softmax")
def scaled_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """``scores`` ``[..., s_q, s_k]`` with queries at the last ``s_q`` key positions (query ``i``
    sees keys ``0 .. s_k - s_q + i``)."""
    s_q, s_k = scores.shape[-2:]
    query_pos = torch.arange(s_k - s_q, s_k, device=scores.device).unsqueeze(1)
    future = torch.arange(s_k, device=scores.device).unsqueeze(0) > query_pos
    logits = (scores.float() * scale).masked_fill(future, float("-inf"))
    return torch.softmax(logits, dim=-1).to(scores.dtype)


def masked_scaled_softmax(scores: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(scale * scores)`` in fp32 over the keys ``allowed`` (boolean, broadcast to ``scores``;
    every row allows at least one key), cast back to the scores' dtype."""
    logits = (scores.float() * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, dim=-1).to(scores.dtype)
