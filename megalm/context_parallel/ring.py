"""Ring attention (``--cp-comm-type p2p``): K/V blocks travel the context-parallel ring.

Rank ``r`` of ``CP`` holds queries, keys and values of chunks ``(r, 2CP-1-r)`` (:mod:`.chunks`),
``[b, n, 2c, d]`` heads-first.  In step ``t = 0..CP-1`` it holds the K/V of rank ``src = r - t``
(mod ``CP``) and attends to it with the part of the causal mask that is not empty:

- ``t = 0``: its own K/V, causal (the local order is the global order);
- ``src < r``: every query against the first K/V chunk ``src``, unmasked;
- ``src > r``: the second query chunk ``2CP-1-r`` against both K/V chunks, unmasked;

so each step after the first is half a block, the same on every rank.  A block is computed
:data:`TILE_ROWS` query rows at a time (its fp32 scores and probabilities are ``[b, n, TILE_ROWS,
keys]``; causal tiles stop at their last row's key).  Each block gives
``O_t = softmax(S_t) V_t`` and ``L_t = logsumexp(S_t)`` row-wise (``S = q k^T / sqrt(d)``); they
merge as ``L = log(e^L + e^L_t)``, ``O = e^(L_old - L) O + e^(L_t - L) O_t``.  With bf16/fp16
inputs the GEMMs and the blocks sent run in the input dtype; scores, ``L``, the merge and the dQ
accumulator are fp32.

Communication, forward: ``CP - 1`` shifts of the stacked ``[2, b, g, 2c, d]`` K/V (only the
``g`` KV heads under GQA) to the next rank (isend/irecv), each posted before the block in hand
is computed so the two overlap.  Backward (recomputing ``P = exp(S - L)`` per block with
``D = rowsum(dO * O)``: ``dV = P^T dO``, ``dS = P (dO V^T - D)``, ``dQ = dS K / sqrt(d)``,
``dK = dS^T Q / sqrt(d)``): the same ``CP - 1`` K/V shifts, plus ``CP`` shifts of the dK/dV
accumulator, which follows its K/V around the ring, gathering each rank's part, and arrives home
after the last step.  Bytes sent per rank per layer: ``(CP-1) 2 b g 2c d`` forward and
``(2CP-1) 2 b g 2c d`` backward, in the element size.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megalm.parallel_state import group_rank, group_size

_TAG_KV, _TAG_DKV = 1, 2
# Query rows per tile of a block: its fp32 scores and probabilities are [b, n, TILE_ROWS, keys].
TILE_ROWS = 256


class _Shift:
    """A send to the next rank and a receive from the previous one in flight."""

    def __init__(self, ring: "_Ring", tensor: torch.Tensor, tag: int):
        self.sent, self.received = tensor, torch.empty_like(tensor)
        self.works = [
            dist.isend(tensor, ring.next, group=ring.group, tag=tag),
            dist.irecv(self.received, ring.prev, group=ring.group, tag=tag),
        ]

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.received


class _Ring:
    def __init__(self, group):
        self.group, self.size, self.rank = group, group_size(group), group_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)


def _expand(kv: torch.Tensor, queries_per_group: int) -> torch.Tensor:
    """``[b, g, s, d]`` -> ``[b, g * q, s, d]`` (query head ``h`` uses group ``h // q``)."""
    if queries_per_group == 1:
        return kv
    b, g, s, d = kv.shape
    return kv.unsqueeze(2).expand(b, g, queries_per_group, s, d).reshape(b, g * queries_per_group, s, d)


def _fold(grad: torch.Tensor, queries_per_group: int) -> torch.Tensor:
    """Sum of an expanded K/V gradient over each group's query heads (inverse of :func:`_expand`)."""
    if queries_per_group == 1:
        return grad
    b, n, s, d = grad.shape
    return grad.view(b, n // queries_per_group, queries_per_group, s, d).sum(2)


def _scores(q, k, scale: float, causal_offset: Optional[int]) -> torch.Tensor:
    """``scale q k^T`` in fp32 at least (bf16/fp16 inputs: the GEMM in their dtype, the softmax
    statistics in fp32); with ``causal_offset`` query row ``i`` sees keys ``0..causal_offset + i``."""
    scores = torch.matmul(q, k.transpose(-2, -1)).to(_stat_dtype(q.dtype)).mul_(scale)
    if causal_offset is not None:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(causal_offset + 1)
        scores.masked_fill_(mask, float("-inf"))
    return scores


def _row_tiles(rows: int, keys: int, tile_rows: int, causal: bool):
    """``(row slice, keys it needs, causal offset or None)`` per query tile of a block: bounds the
    fp32 scores and probabilities of a block to ``tile_rows x keys`` per head."""
    for start in range(0, rows, tile_rows):
        end = min(start + tile_rows, rows)
        yield slice(start, end), (end if causal else keys), (start if causal else None)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _block_forward(q, k, v, scale: float, causal: bool, tile_rows: int):
    """``(softmax(S) V, logsumexp(S))`` of one block, ``S = scale q k^T`` (+ the causal mask); both
    in fp32 at least, computed ``tile_rows`` query rows at a time."""
    stat = _stat_dtype(q.dtype)
    out = torch.empty(q.shape, dtype=stat, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=stat, device=q.device)
    for rows, keys, offset in _row_tiles(q.shape[2], k.shape[2], tile_rows, causal):
        scores = _scores(q[:, :, rows], k[:, :, :keys], scale, offset)
        lse[:, :, rows] = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[:, :, rows].unsqueeze(-1)).to(v.dtype)
        out[:, :, rows] = torch.matmul(probs, v[:, :, :keys])
    return out, lse


def _block_backward(q, k, v, grad_out, lse, delta, scale: float, causal: bool, tile_rows: int):
    """``(dQ, dK, dV)`` of one block given the merged ``lse`` and ``delta = rowsum(dO * O)``, computed
    ``tile_rows`` query rows at a time."""
    grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
    grad_k = torch.zeros_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.zeros_like(v, memory_format=torch.contiguous_format)
    for rows, keys, offset in _row_tiles(q.shape[2], k.shape[2], tile_rows, causal):
        qt, kt, vt, dout = q[:, :, rows], k[:, :, :keys], v[:, :, :keys], grad_out[:, :, rows]
        probs = torch.exp(_scores(qt, kt, scale, offset) - lse[:, :, rows].unsqueeze(-1))
        grad_v[:, :, :keys] += torch.matmul(probs.to(q.dtype).transpose(-2, -1), dout)
        grad_scores = probs * (torch.matmul(dout, vt.transpose(-2, -1)).to(probs.dtype) - delta[:, :, rows, None])
        grad_scores = grad_scores.to(q.dtype)
        grad_q[:, :, rows] = torch.matmul(grad_scores, kt).mul_(scale)
        grad_k[:, :, :keys] += torch.matmul(grad_scores.transpose(-2, -1), qt).mul_(scale)
    return grad_q, grad_k, grad_v


def _merge(out, lse, block_out, block_lse, rows: slice) -> None:
    """Fold a block's ``(O_t, L_t)`` into rows ``rows`` of the running ``(O, L)`` (in place)."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old - new).unsqueeze(-1) + block_out * torch.exp(
        block_lse - new
    ).unsqueeze(-1)
    lse[..., rows] = new


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale: float, tile_rows: int):
        ring = _Ring(group)
        qpg, half = q.shape[1] // k.shape[1], q.shape[2] // 2
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(ring.size):
            shift = _Shift(ring, kv, _TAG_KV) if step + 1 < ring.size else None
            src = (ring.rank - step) % ring.size
            kk, vv = (_expand(t, qpg) for t in kv)
            if step == 0:
                out, lse = _block_forward(q, kk, vv, scale, True, tile_rows)
            elif src < ring.rank:
                block = _block_forward(q, kk[:, :, :half], vv[:, :, :half], scale, False, tile_rows)
                _merge(out, lse, *block, slice(None))
            else:
                block = _block_forward(q[:, :, half:], kk, vv, scale, False, tile_rows)
                _merge(out, lse, *block, slice(half, None))
            if shift is not None:
                kv = shift.wait()
        out = out.to(q.dtype)  # merged in fp32 at least
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.tile_rows = group, scale, tile_rows
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, tile = _Ring(ctx.group), ctx.scale, ctx.tile_rows
        qpg, half = q.shape[1] // k.shape[1], q.shape[2] // 2
        grad_out = grad_out.contiguous()
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        grad_q = torch.zeros_like(q, dtype=lse.dtype)  # accumulated in fp32 at least
        kv = torch.stack([k, v])
        grad_shift = None
        for step in range(ring.size):
            shift = _Shift(ring, kv, _TAG_KV) if step + 1 < ring.size else None
            src = (ring.rank - step) % ring.size
            kk, vv = (_expand(t, qpg) for t in kv)
            if step == 0:
                dq, dk, dv = _block_backward(q, kk, vv, grad_out, lse, delta, scale, True, tile)
                grad_q += dq
                grad_kv = torch.stack([_fold(dk, qpg), _fold(dv, qpg)])
            elif src < ring.rank:
                dq, dk, dv = _block_backward(
                    q, kk[:, :, :half], vv[:, :, :half], grad_out, lse, delta, scale, False, tile
                )
                grad_q += dq
                grad_kv = torch.zeros_like(kv)
                grad_kv[0, :, :, :half], grad_kv[1, :, :, :half] = _fold(dk, qpg), _fold(dv, qpg)
            else:
                rows = slice(half, None)
                dq, dk, dv = _block_backward(
                    q[:, :, rows], kk, vv, grad_out[:, :, rows], lse[..., rows], delta[..., rows], scale, False, tile
                )
                grad_q[:, :, rows] += dq
                grad_kv = torch.stack([_fold(dk, qpg), _fold(dv, qpg)])
            if grad_shift is not None:  # the accumulator of this K/V, from the ranks it visited before
                grad_kv += grad_shift.wait()
            grad_shift = _Shift(ring, grad_kv, _TAG_DKV)
            if shift is not None:
                kv = shift.wait()
        grad_kv = grad_shift.wait()  # this rank's own K/V, back from its trip round the ring
        return grad_q.to(q.dtype), grad_kv[0], grad_kv[1], None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, tile_rows: int = TILE_ROWS
) -> torch.Tensor:
    """Causal attention of this rank's two chunks over the whole sequence of ``group``.

    ``q`` ``[b, n, 2c, d]``, ``k``/``v`` ``[b, g, 2c, d]`` (``n`` a multiple of ``g``), heads-first;
    returns ``[b, n, 2c, d]``.  ``tile_rows``: query rows per tile of each block's computation."""
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), group, q.shape[-1] ** -0.5, tile_rows)
