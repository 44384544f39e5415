"""PowerSGD (Vogels et al. 2019): rank-``r`` approximation of each gradient matrix, two all-reduces.

For every matrix ``M_i`` (``[n, m]``, of :func:`~.segments.matrix_segments`) with
``(n + m) r < n m`` (rank ``r = min(--powersgd-rank, n, m)``; smaller ones, vectors and biases
are sent uncompressed), each rank of the ``K`` holds the compensated ``M_i^(k)`` and the shared
warm-start ``Q_i`` (``[m, r]``; at the first step drawn from a generator seeded by the bucket
and the matrix index, the same on every rank):

1. ``P_i = M_i^(k) Q_i``; one all-reduce (SUM) of ``[uncompressed elements, P_1, P_2, ...]``.
2. ``P^_i = orth(sum_k P_i)`` (reduced QR: orthonormal columns spanning ``M Q``); ``Q_i^(k) =
   M_i^(k)T P^_i``; one all-reduce (SUM) of ``[Q_1, Q_2, ...]``.
3. Result ``P^_i (sum_k Q_i^(k))^T``; this rank sent ``P^_i Q_i^(k)T``, so its residual is
   ``M_i^(k) - P^_i Q_i^(k)T`` (zero for the uncompressed elements).  ``Q_i <- sum_k Q_i^(k)``
   for the next step (a column that came out zero keeps its previous value).

Bytes per rank (ring): ``2 (K-1)/K x 4 (u + r sum_i (n_i + m_i))`` for ``u`` uncompressed
elements, against ``2 (K-1)/K x 4 N``.  When the summed matrix has rank ``<= r``, ``P^`` spans its
column space and the result equals the exact sum (up to rounding).

Both collectives go through ``job.all_reduce`` (SUM): over the data-parallel group here, over
torchft's replica groups in :mod:`megalm.resilience.torchft_compression` (the same math).
"""

from __future__ import annotations

from typing import List

import torch

from megalm.distributed.compression.segments import Segment, remainder_mask_indices


def compressed_rank(seg: Segment, rank: int) -> int:
    """The rank used for ``seg`` (0: sent uncompressed)."""
    n, m = seg.shape
    r = min(rank, n, m)
    return r if (n + m) * r < n * m else 0


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s (reduced QR, deterministic: the same on every rank)."""
    return torch.linalg.qr(p, mode="reduced").Q


def initial_q(key: str, index: int, cols: int, rank: int, device) -> torch.Tensor:
    seed = sum(ord(c) * 131**i for i, c in enumerate(key)) % (2**31) * 1009 + index
    g = torch.Generator().manual_seed(seed)
    return torch.randn(cols, rank, generator=g, dtype=torch.float32).to(device)


class PowerSGD:
    """``--grad-compression powersgd`` (``--powersgd-rank``); holds the warm-start ``Q`` per matrix."""

    name = "powersgd"

    def __init__(self, rank: int):
        self.rank = rank
        self.qs = {}  # "<bucket key>/<matrix index>" -> Q [m, r]

    def _q(self, key: str, i: int, seg: Segment, r: int, device) -> torch.Tensor:
        name = f"{key}/{i}"
        if name not in self.qs:
            self.qs[name] = initial_q(key, i, seg.shape[1], r, device)
        return self.qs[name]

    def stages(self, job) -> List:
        numel, device = job.numel, job.device
        mats = [(i, s, compressed_rank(s, self.rank)) for i, s in enumerate(job.matrices)]
        mats = [(i, s, r) for i, s, r in mats if r > 0]
        plain = remainder_mask_indices(numel, [s for _, s, _ in mats])
        u = sum(e - s for s, e in plain)
        p_sizes = [s.shape[0] * r for _, s, r in mats]
        q_sizes = [s.shape[1] * r for _, s, r in mats]
        first = torch.empty(u + sum(p_sizes), dtype=torch.float32, device=device)
        second = torch.empty(sum(q_sizes), dtype=torch.float32, device=device)
        views = {}

        def mat(s):
            return job.a[s.start : s.end].view(s.shape)

        def send_p():
            a = job.a
            cursor = 0
            for s, e in plain:
                first[cursor : cursor + e - s] = a[s:e]
                cursor += e - s
            for (i, s, r), size in zip(mats, p_sizes):
                q = self._q(job.key, i, s, r, device)
                torch.matmul(mat(s), q, out=first[cursor : cursor + size].view(-1, r))
                cursor += size
            first.add_(job.poison)
            return job.all_reduce(first, "powersgd_p_all_reduce")

        def send_q():
            cursor = u
            qc = 0
            for (i, s, r), psize, qsize in zip(mats, p_sizes, q_sizes):
                p_hat = orthogonalize(first[cursor : cursor + psize].view(-1, r))
                views[i] = p_hat
                torch.matmul(mat(s).t(), p_hat, out=second[qc : qc + qsize].view(-1, r))
                cursor += psize
                qc += qsize
            job.sent = job.a.clone()  # uncompressed elements: sent as they are
            qc = 0
            for (i, s, r), qsize in zip(mats, q_sizes):
                job.sent[s.start : s.end] = (views[i] @ second[qc : qc + qsize].view(-1, r).t()).view(-1)
                qc += qsize
            return job.all_reduce(second, "powersgd_q_all_reduce")

        def receive():
            out = torch.empty_like(job.a)
            cursor = 0
            for s, e in plain:
                out[s:e] = first[cursor : cursor + e - s]
                cursor += e - s
            qc = 0
            finite = torch.isfinite(second).all()
            for (i, s, r), qsize in zip(mats, q_sizes):
                q_sum = second[qc : qc + qsize].view(-1, r)
                out[s.start : s.end] = (views[i] @ q_sum.t()).view(-1)
                old = self.qs[f"{job.key}/{i}"]
                keep = (q_sum.abs().sum(dim=0) > 0) & finite
                self.qs[f"{job.key}/{i}"] = torch.where(keep[None, :], q_sum, old)
                qc += qsize
            job.out = out

        return [send_p, send_q, receive]

    def state_dict(self) -> dict:
        return {f"q/{k}": v for k, v in self.qs.items()}

    def load_state_dict(self, state: dict) -> None:
        self.qs = {k[2:]: v for k, v in state.items() if k.startswith("q/")}
