"""Causal attention computed in blocks of queries (``--attention-backend blocked``; what ``auto``
picks on a CPU in fp32 when there is no attention dropout).

Per (batch, head), with ``S = scale Q K^T + causal mask`` and ``P = softmax(S)`` row-wise::

    O  = P V
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - rowsum(P * dP)),   dQ = scale dS K,   dK = scale dS^T Q

The queries are taken :data:`BLOCK` rows at a time: rows ``[r0, r1)`` only see keys ``[0, r1)``,
so each block's scores are a ``[BLOCK, r1]`` GEMM and only their last ``BLOCK`` columns need
the mask.  About half of the ``s^2`` scores (those above the diagonal) are never computed, in
forward or backward, and every product is one batched GEMM over all heads, large enough to run
near the matmul peak.  Forward keeps each block's probabilities ``P`` for backward (no
recomputation): ``B b n s (s + BLOCK) / 2`` bytes per layer, where a flash kernel keeps the
``b n s`` log-sum-exps.  Measured on a 2-core CPU (fp32, head dim 64, forward + backward of
one layer) it took 0.76x the time of PyTorch's SDPA (its flash CPU kernel) at ``b 8, n 4, s 256``
and 0.63x at ``b 4, n 8, s 512``; on a GPU, SDPA / flash-attn are the right kernels.

With a document mask (``--reset-attention-mask``: boolean ``[b, 1, s, s]``, True where allowed,
already causal) each block adds ``-inf`` where its ``[BLOCK, r1]`` slice of the mask is False
instead of the causal triangle; the same keys are skipped, the backward is unchanged (masked
probabilities are 0).

The output is written straight into ``[s, b, n, d]`` memory (what ``linear_proj`` reads), so
no context copy is made.  No communication: each tensor-parallel rank runs its own heads.
"""

from __future__ import annotations

from typing import List, Optional

import torch

# Query rows per block: 64 ran fastest of 32 / 64 / 128 for head dim 64 at s 256 and 512.
BLOCK = 64


def block_ranges(seq: int):
    """The query blocks ``(start, end)`` of a sequence of ``seq`` positions."""
    for start in range(0, seq, BLOCK):
        yield start, min(start + BLOCK, seq)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[b, n, s, d]`` -> ``[b n, s, d]`` (a view when the layout allows, as for ``[s, b, n, d]`` memory)."""
    b, n, s, d = t.shape
    return t.reshape(b * n, s, d)


class _BlockedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, allowed):
        heads, seq, dim = q.shape
        mask = torch.full((BLOCK, BLOCK), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
        samples = 1 if allowed is None else allowed.shape[0]
        out = torch.empty(seq, heads, dim, dtype=q.dtype, device=q.device).transpose(0, 1)  # [s, bn, d] memory
        probs: List[torch.Tensor] = []
        softmax_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        for start, end in block_ranges(seq):
            scores = torch.bmm(q[:, start:end], k[:, :end].transpose(1, 2)).mul_(scale)
            if allowed is None:
                scores[:, :, start:end] += mask[: end - start, : end - start]
            else:  # [b n, r, c] viewed as [b, n, r, c] against the mask's [b, 1, r, c]
                blocked = ~allowed[:, :, start:end, :end]
                scores.view(samples, heads // samples, end - start, end).masked_fill_(blocked, float("-inf"))
            p = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
            out[:, start:end] = torch.bmm(p, v[:, :end])
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *probs = ctx.saved_tensors
        grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
        grad_k = torch.zeros_like(k, memory_format=torch.contiguous_format)
        grad_v = torch.zeros_like(v, memory_format=torch.contiguous_format)
        for (start, end), p in zip(block_ranges(q.shape[1]), probs):
            g = grad_out[:, start:end]
            grad_v[:, :end].baddbmm_(p.transpose(1, 2), g)
            grad_scores = torch._softmax_backward_data(torch.bmm(g, v[:, :end].transpose(1, 2)), p, -1, p.dtype)
            grad_scores.mul_(ctx.scale)
            grad_q[:, start:end] = torch.bmm(grad_scores, k[:, :end])
            grad_k[:, :end].baddbmm_(grad_scores.transpose(1, 2), q[:, start:end])
        return grad_q, grad_k, grad_v, None, None


def blocked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + causal) v`` for ``[b, n, s, d]`` q, k, v (the same heads; expand
    grouped k/v first); with ``allowed`` (boolean ``[b, 1, s, s]``, within the causal triangle) the
    scores outside it are ``-inf`` instead.  Returns ``[b, n, s, d]`` whose memory is ``[s, b, n, d]``."""
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, n, s, d = q.shape
    if allowed is not None and tuple(allowed.shape) != (b, 1, s, s):
        raise ValueError(f"the attention mask must have shape {(b, 1, s, s)}, got {tuple(allowed.shape)}")
    out = _BlockedCausalAttention.apply(_heads_first(q), _heads_first(k), _heads_first(v), d**-0.5, allowed)
    return out.view(b, n, s, d)
