"""Ring attention (``--cp-comm-type p2p``): K/V blocks travel the context-parallel ring.

Rank ``r`` of ``CP`` holds queries, keys and values of chunks ``(r, 2CP-1-r)`` (:mod:`.chunks`),
``[b, n, 2c, d]`` heads-first.  In step ``t = 0..CP-1`` it holds the K/V of rank ``src = r - t``
(mod ``CP``) and attends to it with the part of the causal mask that is not empty:

- ``t = 0``: its own K/V, causal (the local order is the global order);
- ``src < r``: every query against the first K/V chunk ``src``, unmasked;
- ``src > r``: the second query chunk ``2CP-1-r`` against both K/V chunks, unmasked;

so each step after the first is half a block, the same on every rank.  A block is computed
tile by tile by :mod:`.blocks` (:data:`.blocks.TILE_ROWS` query rows at a time; causal tiles stop
at their last row's key).  Each block gives ``O_t = softmax(S_t) V_t`` and ``L_t = logsumexp(S_t)``
row-wise (``S = q k^T / sqrt(d)``); they merge as ``L = log(e^L + e^L_t)``, ``O = e^(L_old - L) O +
e^(L_t - L) O_t``.  With attention dropout (:mod:`.keyed_dropout`) each block multiplies its
probabilities by the mask entries of its rows' and keys' global positions, in forward and again
in backward, so the result equals one process's.

Packed documents (``--qkv-format thd``; ``documents``, every position's document id ``[b, s]`` over the
whole sequence): each block also masks the keys of other documents (:class:`.blocks.BlockDocuments`,
from the global positions of its rows and keys).  A block can then hold no key of some rows'
documents: those rows have ``L_t = -inf`` and add nothing to the merge or the gradients (the guards
are in :mod:`.blocks`).  A block where no row shares a document with any key is skipped, in forward
and backward (one host sync per forward decides which; the K/V and dK/dV shifts run all the same).
The sequence keeps the load-balanced split of :mod:`.chunks`, not Megatron's per-document ``2 x CP``
split (Transformer Engine's THD ring, each document padded to a multiple of ``2 CP``): no padding and
the same results, but each block computes its masked ``rows x keys`` scores (cross-document pairs
included) where TE's kernels compute only within documents, and with short documents the skipped
blocks make the ranks' work uneven.  With bf16/fp16 inputs the GEMMs and the blocks
sent run in the input dtype; scores, ``L``, the merge and the dQ accumulator are fp32.

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

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megalm.context_parallel.blocks import (
    TILE_ROWS,
    BlockDocuments,
    BlockDropout,
    block_backward,
    block_forward,
    expand,
    fold,
    merge,
)
from megalm.context_parallel.chunks import local_positions
from megalm.context_parallel.keyed_dropout import KeyedDropout
from megalm.parallel_state import group_rank, group_size

_TAG_KV, _TAG_DKV = 1, 2


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

    def block(self, step: int, half: int) -> Tuple[slice, slice, Optional[int]]:
        """``(query rows, keys of the K/V in hand, causal diagonal or None)`` of step ``step``'s block."""
        src = (self.rank - step) % self.size
        if step == 0:
            return slice(None), slice(None), 0
        if src < self.rank:
            return slice(None), slice(0, half), None
        return slice(half, None), slice(None), None

    def block_dropout(self, dropout: Optional[KeyedDropout], step: int, q, rows: slice, keys: slice):
        """The :class:`.blocks.BlockDropout` of step ``step``'s block: its rows' and keys' global positions."""
        if dropout is None:
            return None
        seq, src = q.shape[2] * self.size, (self.rank - step) % self.size
        own, held = (local_positions(seq, r, self.size, q.device) for r in (self.rank, src))
        return BlockDropout(dropout, own[rows], held[keys])

    def block_documents(self, documents: Optional[torch.Tensor], step: int, q, rows: slice, keys: slice):
        """The :class:`.blocks.BlockDocuments` of step ``step``'s block: its rows' and keys' document ids."""
        if documents is None:
            return None
        seq, src = q.shape[2] * self.size, (self.rank - step) % self.size
        own, held = (local_positions(seq, r, self.size, documents.device) for r in (self.rank, src))
        return BlockDocuments(documents[:, own[rows]], documents[:, held[keys]])

    def computed_steps(self, documents: Optional[torch.Tensor], q) -> List[bool]:
        """Per step, whether its block has any unmasked entry (always, without documents); one host sync."""
        if documents is None:
            return [True] * self.size
        half = q.shape[2] // 2
        blocks = (self.block_documents(documents, t, q, *self.block(t, half)[:2]) for t in range(self.size))
        return torch.stack([block.any_shared() for block in blocks]).tolist()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale: float, tile_rows: int, dropout: Optional[KeyedDropout], documents):
        ring = _Ring(group)
        qpg, half = q.shape[1] // k.shape[1], q.shape[2] // 2
        computed = ring.computed_steps(documents, q)  # step 0 always: every row sees its own key
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(ring.size):
            shift = _Shift(ring, kv, _TAG_KV) if step + 1 < ring.size else None
            rows, keys, diagonal = ring.block(step, half)
            if step == 0 or computed[step]:
                kk, vv = (expand(t[:, :, keys], qpg) for t in kv)
                block_drop = ring.block_dropout(dropout, step, q, rows, keys)
                block_docs = ring.block_documents(documents, step, q, rows, keys)
                block = block_forward(q[:, :, rows], kk, vv, scale, diagonal, tile_rows, block_drop, block_docs)
                if step == 0:
                    out, lse = block
                else:
                    merge(out, lse, *block, rows)
            if shift is not None:
                kv = shift.wait()
        out = out.to(q.dtype)  # merged in fp32 at least
        ctx.save_for_backward(q, k, v, out, lse, documents)
        ctx.group, ctx.scale, ctx.tile_rows, ctx.dropout, ctx.computed = group, scale, tile_rows, dropout, computed
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, documents = ctx.saved_tensors
        ring, scale, tile = _Ring(ctx.group), ctx.scale, ctx.tile_rows
        qpg, half = q.shape[1] // k.shape[1], q.shape[2] // 2
        grad_out = grad_out.contiguous()
        delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        grad_q = torch.zeros_like(q, dtype=lse.dtype)  # accumulated in fp32 at least
        kv = torch.stack([k, v])
        grad_shift = None
        for step in range(ring.size):
            shift = _Shift(ring, kv, _TAG_KV) if step + 1 < ring.size else None
            rows, keys, diagonal = ring.block(step, half)
            grad_kv = torch.zeros_like(kv)
            if step == 0 or ctx.computed[step]:
                kk, vv = (expand(t[:, :, keys], qpg) for t in kv)
                dq, dk, dv = block_backward(
                    q[:, :, rows],
                    kk,
                    vv,
                    grad_out[:, :, rows],
                    lse[..., rows],
                    delta[..., rows],
                    scale,
                    diagonal,
                    tile,
                    ring.block_dropout(ctx.dropout, step, q, rows, keys),
                    ring.block_documents(documents, step, q, rows, keys),
                )
                grad_q[:, :, rows] += dq
                grad_kv[0, :, :, keys], grad_kv[1, :, :, keys] = fold(dk, qpg), fold(dv, qpg)
            if grad_shift is not None:  # the accumulator of this K/V, from the ranks it visited before
                grad_kv += grad_shift.wait()
            grad_shift = _Shift(ring, grad_kv, _TAG_DKV)
            if shift is not None:
                kv = shift.wait()
        grad_kv = grad_shift.wait()  # this rank's own K/V, back from its trip round the ring
        return grad_q.to(q.dtype), grad_kv[0], grad_kv[1], None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    tile_rows: int = TILE_ROWS,
    dropout: Optional[KeyedDropout] = None,
    documents: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention of this rank's two chunks over the whole sequence of ``group``.

    ``q`` ``[b, n, 2c, d]``, ``k``/``v`` ``[b, g, 2c, d]`` (``n`` a multiple of ``g``), heads-first;
    returns ``[b, n, 2c, d]``.  ``tile_rows``: query rows per tile of each block's computation;
    ``dropout``: the call's position-keyed attention dropout (each block draws its positions' entries);
    ``documents``: packed documents' ids ``[b, s]`` over the whole sequence (a query sees only keys of its
    own document), or None."""
    scale = q.shape[-1] ** -0.5
    return _RingAttention.apply(q, k.contiguous(), v.contiguous(), group, scale, tile_rows, dropout, documents)
