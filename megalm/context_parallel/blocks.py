"""Attention blocks computed tile by tile, with log-sum-exp statistics, optional keyed dropout and
optional packed documents.

The math the ring (:mod:`.ring`) runs per step, and :func:`local_attention`, the same math as one
local core (the whole causal matrix, or one chunk's rows against keys it may see), which the
cores use when attention dropout is on.  Heads-first tensors: ``q`` ``[b, n, rows, d]``, ``k``/``v``
``[b, n, keys, d]`` (GQA groups expanded by :func:`expand`).

A block is computed :data:`TILE_ROWS` query rows at a time (its fp32 scores and probabilities are
``[b, n, TILE_ROWS, keys]``).  With ``diagonal`` ``t`` the block is causal with query row ``i``
seeing keys ``0..t + i`` (so a tile stops at its last row's key); ``None``: unmasked.  Per block,
with ``S = scale q k^T`` (+ mask), ``L = logsumexp(S)`` row-wise, ``P = exp(S - L)`` and the dropout
scale ``Z`` (``keep / (1 - p)`` from :class:`.keyed_dropout.KeyedDropout`, or 1)::

    O = (P Z) V                                   forward, with L kept
    dV = (P Z)^T dO,   dS = P (Z (dO V^T) - D),   dQ = scale dS K,   dK = scale dS^T Q

where ``D = rowsum(dO * O)`` (equal to ``rowsum(P Z dO V^T)``, so dropout leaves it unchanged).
Blocks of one query row set merge as ``L = log(e^L + e^L_t)``, ``O = e^(L_old - L) O + e^(L_t - L)
O_t`` (:func:`merge`), also with dropout, since ``Z`` scales the final probabilities.  The backward
recomputes ``P`` and ``Z`` from ``L`` and the positions: nothing ``s x s`` is stored.

Packed documents (:class:`BlockDocuments`, ``--qkv-format thd``): each tile also masks the keys of
other documents (a boolean ``[b, 1, tile rows, keys]`` from the rows' and keys' document ids).  A
block may then hold no key of a row's document: that row's ``S`` is all ``-inf`` and ``L_t = -inf``.
Such rows are exact zeros, never NaN: ``P = exp(S - L)`` subtracts ``0`` where ``L = -inf``
(:func:`_finite`), so ``O_t = 0``; the merge rescales by ``exp(L - L_new)`` with the same guard, so
a ``-inf`` block adds nothing (``e^-inf = 0``) and two ``-inf`` ones stay ``O = 0, L = -inf``; the
backward's ``P`` is ``0`` there, so the row's block gives no gradient to q, k or v.  With bf16/fp16
inputs the GEMMs run in the input dtype; scores, ``L``, the merge and dQ are fp32.
No communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megalm.context_parallel.keyed_dropout import KeyedDropout

# Query rows per tile of a block: its fp32 scores and probabilities are [b, n, TILE_ROWS, keys].
TILE_ROWS = 256


@dataclass(frozen=True)
class BlockDropout:
    """Keyed dropout of one block: the global positions of its query rows and of its keys."""

    dropout: KeyedDropout
    query_pos: torch.Tensor
    key_pos: torch.Tensor

    def rows(self, rows: slice) -> "BlockDropout":
        return BlockDropout(self.dropout, self.query_pos[rows], self.key_pos)

    def keys(self, keys: slice) -> "BlockDropout":
        return BlockDropout(self.dropout, self.query_pos, self.key_pos[keys])

    def tile(self, q: torch.Tensor, rows: slice, keys: int, dtype: torch.dtype) -> torch.Tensor:
        """``Z`` of query rows ``rows`` of the block against its first ``keys`` keys."""
        return self.dropout.scale(q.shape[0], q.shape[1], self.query_pos[rows], self.key_pos[:keys], dtype)


def expand(kv: torch.Tensor, queries_per_group: int) -> torch.Tensor:
    """``[b, g, s, d]`` -> ``[b, g * q, s, d]`` (query head ``h`` uses group ``h // q``)."""
    if queries_per_group == 1:
        return kv
    b, g, s, d = kv.shape
    return kv.unsqueeze(2).expand(b, g, queries_per_group, s, d).reshape(b, g * queries_per_group, s, d)


def fold(grad: torch.Tensor, queries_per_group: int) -> torch.Tensor:
    """Sum of an expanded K/V gradient over each group's query heads (inverse of :func:`expand`)."""
    if queries_per_group == 1:
        return grad
    b, n, s, d = grad.shape
    return grad.view(b, n // queries_per_group, queries_per_group, s, d).sum(2)


@dataclass(frozen=True)
class BlockDocuments:
    """Packed documents of one block: the document id of each query row ``[b, rows]`` and of each key
    ``[b, keys]`` (a row sees only keys of its own document)."""

    query_docs: torch.Tensor
    key_docs: torch.Tensor

    def tile(self, rows: slice, keys: int) -> torch.Tensor:
        """True where query rows ``rows`` may see the block's first ``keys`` keys: ``[b, 1, rows, keys]``."""
        return (self.query_docs[:, rows, None] == self.key_docs[:, None, :keys]).unsqueeze(1)

    def any_shared(self) -> torch.Tensor:
        """0-d bool tensor: does some row of some batch entry share a document with some key (else the
        whole block is masked)?  ``isin`` per batch entry: no ``rows x keys`` tensor."""
        return torch.stack([torch.isin(qd, kd).any() for qd, kd in zip(self.query_docs, self.key_docs)]).any()


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with ``-inf`` (a fully masked row) replaced by 0, to subtract from ``-inf`` scores safely."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _scores(q, k, scale: float, causal_offset: Optional[int], allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scale q k^T`` in fp32 at least (bf16/fp16 inputs: the GEMM in their dtype, the softmax
    statistics in fp32); with ``causal_offset`` query row ``i`` sees keys ``0..causal_offset + i``;
    ``allowed``: a boolean mask broadcast to the scores (False: ``-inf``), or None."""
    scores = torch.matmul(q, k.transpose(-2, -1)).to(stat_dtype(q.dtype)).mul_(scale)
    if causal_offset is not None:
        sq, sk = scores.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu_(causal_offset + 1)
        scores.masked_fill_(mask, float("-inf"))
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    return scores


def _row_tiles(rows: int, keys: int, tile_rows: int, diagonal: Optional[int]):
    """``(row slice, keys it needs, causal offset or None)`` per query tile of a block: bounds the
    fp32 scores and probabilities of a block to ``tile_rows x keys`` per head."""
    for start in range(0, rows, tile_rows):
        end = min(start + tile_rows, rows)
        if diagonal is None:
            yield slice(start, end), keys, None
        else:
            yield slice(start, end), min(keys, diagonal + end), diagonal + start


def _allowed(documents: Optional[BlockDocuments], rows: slice, keys: int) -> Optional[torch.Tensor]:
    return None if documents is None else documents.tile(rows, keys)


def block_forward(q, k, v, scale: float, diagonal: Optional[int], tile_rows: int, dropout=None, documents=None):
    """``((P Z) V, L)`` of one block (``dropout``: a :class:`BlockDropout` or None; ``documents``: a
    :class:`BlockDocuments` or None), both in fp32 at least, computed ``tile_rows`` query rows at a
    time.  A row that sees no key has ``O = 0`` and ``L = -inf``."""
    stat = stat_dtype(q.dtype)
    out = torch.empty(q.shape, dtype=stat, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=stat, device=q.device)
    for rows, keys, offset in _row_tiles(q.shape[2], k.shape[2], tile_rows, diagonal):
        scores = _scores(q[:, :, rows], k[:, :, :keys], scale, offset, _allowed(documents, rows, keys))
        tile_lse = torch.logsumexp(scores, dim=-1)
        lse[:, :, rows] = tile_lse
        probs = torch.exp(scores - _finite(tile_lse).unsqueeze(-1))
        if dropout is not None:
            probs.mul_(dropout.tile(q, rows, keys, stat))
        out[:, :, rows] = torch.matmul(probs.to(v.dtype), v[:, :, :keys])
    return out, lse


def block_backward(
    q, k, v, grad_out, lse, delta, scale: float, diagonal: Optional[int], tile_rows: int, dropout=None, documents=None
):
    """``(dQ, dK, dV)`` of one block given the merged ``lse`` and ``delta = rowsum(dO * O)``, computed
    ``tile_rows`` query rows at a time (``Z`` regenerated from the positions, the document mask from
    ``documents``); rows with ``lse = -inf`` get zero gradients."""
    grad_q = torch.empty_like(q, memory_format=torch.contiguous_format)
    grad_k = torch.zeros_like(k, memory_format=torch.contiguous_format)
    grad_v = torch.zeros_like(v, memory_format=torch.contiguous_format)
    for rows, keys, offset in _row_tiles(q.shape[2], k.shape[2], tile_rows, diagonal):
        qt, kt, vt, dout = q[:, :, rows], k[:, :, :keys], v[:, :, :keys], grad_out[:, :, rows]
        scores = _scores(qt, kt, scale, offset, _allowed(documents, rows, keys))
        probs = torch.exp(scores - _finite(lse[:, :, rows]).unsqueeze(-1))
        grad_probs = torch.matmul(dout, vt.transpose(-2, -1)).to(probs.dtype)
        if dropout is None:
            dropped = probs
        else:
            keep_scale = dropout.tile(q, rows, keys, probs.dtype)
            dropped, grad_probs = probs * keep_scale, grad_probs.mul_(keep_scale)
        grad_v[:, :, :keys] += torch.matmul(dropped.to(q.dtype).transpose(-2, -1), dout)
        grad_scores = (probs * (grad_probs - delta[:, :, rows, None])).to(q.dtype)
        grad_q[:, :, rows] = torch.matmul(grad_scores, kt).mul_(scale)
        grad_k[:, :, :keys] += torch.matmul(grad_scores.transpose(-2, -1), qt).mul_(scale)
    return grad_q, grad_k, grad_v


def merge(out, lse, block_out, block_lse, rows: slice) -> None:
    """Fold a block's ``(O_t, L_t)`` into rows ``rows`` of the running ``(O, L)`` (in place); a side
    with ``L = -inf`` (no key seen) weighs 0, and rows where both are ``-inf`` stay ``O = 0``."""
    old = lse[..., rows]
    new = torch.logaddexp(old, block_lse)
    base = _finite(new)
    out[..., rows, :] = out[..., rows, :] * torch.exp(old - base).unsqueeze(-1) + block_out * torch.exp(
        block_lse - base
    ).unsqueeze(-1)
    lse[..., rows] = new


class _LocalAttention(torch.autograd.Function):
    """One block as a whole core: forward keeps ``(q, k, v, O, L)``, backward recomputes the tiles."""

    @staticmethod
    def forward(ctx, q, k, v, diagonal: Optional[int], dropout, tile_rows: int, documents):
        qpg, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        out, lse = block_forward(q, expand(k, qpg), expand(v, qpg), scale, diagonal, tile_rows, dropout, documents)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.diagonal, ctx.dropout, ctx.tile_rows, ctx.documents = diagonal, dropout, tile_rows, documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        qpg, scale = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
        grad_out = grad_out.contiguous()
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        k, v = expand(k, qpg), expand(v, qpg)
        dq, dk, dv = block_backward(
            q, k, v, grad_out, lse, delta, scale, ctx.diagonal, ctx.tile_rows, ctx.dropout, ctx.documents
        )
        return dq, fold(dk, qpg), fold(dv, qpg), None, None, None, None


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    diagonal: Optional[int] = 0,
    dropout: Optional[BlockDropout] = None,
    tile_rows: int = TILE_ROWS,
    documents: Optional[BlockDocuments] = None,
) -> torch.Tensor:
    """``(P Z) V`` of heads-first ``q`` ``[b, n, rows, d]`` against ``k``/``v`` ``[b, g, keys, d]`` (``n``
    a multiple of ``g``): causal with query row ``i`` seeing keys ``0..diagonal + i`` (None: all), and
    with ``documents`` only keys of its own document.  Backward recomputes the tiles (memory ``O(rows)``
    per head besides one tile)."""
    return _LocalAttention.apply(q, k.contiguous(), v.contiguous(), diagonal, dropout, tile_rows, documents)
