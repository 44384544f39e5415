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

With a sliding window (``--window-size``) a block's keys start at ``start - window`` (the scores are
``[BLOCK, window + BLOCK]``: cost linear in the sequence); with softmax sinks (``--softmax-type``) each
block's scores get one more column, the head's sink logit, whose probability is dropped before ``P V``
and whose score gradient, summed over rows, is the sink's gradient.

The output is written straight into ``[s, b, n, d]`` memory (what ``linear_proj`` reads), so
no context copy is made.  No communication: each tensor-parallel rank runs its own heads.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from megalm.transformer.attention_variants import allowed_positions

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


def _block_keys(start: int, end: int, window: Optional[int]) -> int:
    """The first key a query block ``[start, end)`` can see (``0`` without a window)."""
    return 0 if window is None else max(0, start - window)


class _BlockedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, allowed, window, sinks):
        heads, seq, dim = q.shape
        mask = torch.full((BLOCK, BLOCK), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
        samples = 1 if allowed is None else allowed.shape[0]
        out = torch.empty(seq, heads, dim, dtype=q.dtype, device=q.device).transpose(0, 1)  # [s, bn, d] memory
        probs: List[torch.Tensor] = []
        softmax_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        sink_col = None if sinks is None else sinks.to(q.dtype).repeat(samples_of(heads, sinks)).view(heads, 1, 1)
        for start, end in block_ranges(seq):
            lo = _block_keys(start, end, window)
            scores = torch.bmm(q[:, start:end], k[:, lo:end].transpose(1, 2)).mul_(scale)
            if allowed is None and window is None:
                scores[:, :, start:end] += mask[: end - start, : end - start]
            else:
                qpos = torch.arange(start, end, device=q.device)
                blocked = ~allowed_positions(qpos, torch.arange(lo, end, device=q.device), window)
                if allowed is not None:  # [b n, r, c] viewed as [b, n, r, c] against the mask's [b, 1, r, c]
                    blocked = blocked | ~allowed[:, :, start:end, lo:end]
                scores.view(samples, heads // samples, end - start, end - lo).masked_fill_(
                    blocked.view(-1, 1, end - start, end - lo), float("-inf")
                )
            if sink_col is not None:  # one more column: the head's sink logit (no value)
                scores = torch.cat([scores, sink_col.expand(heads, end - start, 1)], dim=-1)
            p = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
            out[:, start:end] = torch.bmm(p[:, :, : end - lo], v[:, lo:end])
            probs.append(p)
        ctx.save_for_backward(q, k, v, *probs)
        ctx.scale, ctx.window, ctx.sinks = scale, window, sinks is not None
        ctx.sink_meta = None if sinks is None else (sinks.shape[0], sinks.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, *probs = ctx.saved_tensors
        grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
        grad_k = torch.zeros_like(k, memory_format=torch.contiguous_format)
        grad_v = torch.zeros_like(v, memory_format=torch.contiguous_format)
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        grad_sink = torch.zeros(q.shape[0], dtype=acc, device=q.device) if ctx.sinks else None
        for (start, end), p in zip(block_ranges(q.shape[1]), probs):
            lo = _block_keys(start, end, ctx.window)
            g = grad_out[:, start:end]
            keys = p[:, :, : end - lo]
            grad_v[:, lo:end].baddbmm_(keys.transpose(1, 2), g)
            grad_probs = torch.bmm(g, v[:, lo:end].transpose(1, 2))
            if ctx.sinks:  # the sink column has no value: its probability gradient is 0
                grad_probs = torch.cat([grad_probs, grad_probs.new_zeros(*grad_probs.shape[:2], 1)], dim=-1)
            grad_scores = torch._softmax_backward_data(grad_probs, p, -1, p.dtype)
            if ctx.sinks:
                grad_sink += grad_scores[:, :, -1].sum(1, dtype=acc)
                grad_scores = grad_scores[:, :, :-1]
            grad_scores = grad_scores.mul_(ctx.scale) if grad_scores.is_contiguous() else grad_scores * ctx.scale
            grad_q[:, start:end] = torch.bmm(grad_scores, k[:, lo:end])
            grad_k[:, lo:end].baddbmm_(grad_scores.transpose(1, 2), q[:, start:end])
        if grad_sink is not None:  # [b n] -> [n]
            n, dtype = ctx.sink_meta
            grad_sink = grad_sink.view(-1, n).sum(0).to(dtype)
        return grad_q, grad_k, grad_v, None, None, None, grad_sink


def samples_of(heads: int, sinks: torch.Tensor) -> int:
    """Batch size of ``[b n]`` flattened heads given the ``[n]`` sinks."""
    return heads // sinks.shape[0]


def blocked_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + causal) v`` for ``[b, n, s, d]`` q, k, v (the same heads; expand
    grouped k/v first); with ``allowed`` (boolean ``[b, 1, s, s]``, within the causal triangle) the
    scores outside it are ``-inf`` instead.  ``window``: query ``i`` sees keys ``i - window .. i`` only
    (blocks start at their first visible key); ``sinks`` ``[n]``: per-head sink logits in each row's
    softmax (gpt-oss, :mod:`megalm.transformer.attention_variants`).  Returns ``[b, n, s, d]`` whose
    memory is ``[s, b, n, d]``."""
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, n, s, d = q.shape
    if allowed is not None and tuple(allowed.shape) != (b, 1, s, s):
        raise ValueError(f"the attention mask must have shape {(b, 1, s, s)}, got {tuple(allowed.shape)}")
    out = _BlockedCausalAttention.apply(
        _heads_first(q), _heads_first(k), _heads_first(v), d**-0.5, allowed, window, sinks
    )
    return out.view(b, n, s, d)
