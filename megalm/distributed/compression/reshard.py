"""Error feedback across a change of layout (data-parallel size, TP/PP, bucket size, method): the
pending update.

After a step, rank ``k`` of a group of ``K`` ranks that compress the same part of a bucket holds
the residual ``e_k`` of what it did not send.  Gradients are pre-scaled by ``1/K``, so what error
feedback still owes the training there is the sum ``P = sum_k e_k`` (in units of the mean
gradient): the next reduction sends an encoding of ``sum_k (g_k / K + e_k) = mean g + P``, and with
a lossless encoding it delivers exactly that.  ``P`` depends on nothing but the parameters: it is
saved like a gradient, one tensor per parameter, and any layout can load it.

* :func:`pending_updates` (collective: one SUM all-reduce of ``N`` fp32 values per gradient buffer
  over its data-parallel group): each rank places its residuals at the bucket coordinates they
  cover (:meth:`Bucket.residual_range`: the whole bucket, or with ``--hierarchical-grad-reduce``
  its node-local chunk ``i``, zeros elsewhere); the sum is ``P`` on every rank of the group, cut
  into the parameters' shapes.
* :func:`load_pending` (no communication): every rank whose residual covers a part gets ``P / K'``
  there (``K'`` ranks share that part: the data-parallel size, or the number of nodes
  hierarchically), so the new residuals add up to ``P`` again (each share is exact when ``K'`` is a
  power of two, else rounded once; the reduction then rounds its sum as it does any gradient's).  A bucket
  that compresses nothing (data-parallel size 1, or one node under hierarchical reduction) adds its
  residual to the next gradient before the exact reduction and keeps none
  (:meth:`~.error_feedback.GradCompressor.flush`).
* PowerSGD's warm-start ``Q`` of a matrix (the same on every rank of the group that reduced it) is
  keyed by the parameter and the rows of it the matrix covers (:func:`powersgd_qs`); a new run
  whose matrix covers the same rows of the same local parameter shape copies it
  (:func:`load_powersgd_qs`), any other starts from a fresh ``Q`` (it is only a warm start).
* Not carried over: the stochastic-rounding generator (each rank's own stream, seeded by its new
  global rank).
"""

from __future__ import annotations

from typing import Dict, Iterator, Sequence, Tuple

import torch

from megalm.distributed import comm
from megalm.distributed.compression import powersgd


def compressed_buffers(model_chunks: Sequence) -> Iterator[Tuple[object, object]]:
    """``(compressor, buffer)`` for every gradient buffer of the chunks built with compression."""
    for chunk in model_chunks:
        compressor = getattr(chunk, "compressor", None)
        if compressor is not None:
            for buf in chunk.all_buffers:
                yield compressor, buf


def bucket_key(buf, bucket) -> str:
    return f"{buf.compress_key}.{bucket.index}"


def pending_updates(model_chunks: Sequence) -> Dict[torch.nn.Parameter, torch.Tensor]:
    """``{parameter: P}`` (fp32, the parameter's local shape) of every compressed buffer; collective
    over each buffer's data-parallel group (every rank of it must call this)."""
    out = {}
    for comp, buf in compressed_buffers(model_chunks):
        placed = torch.zeros(buf.numel, dtype=torch.float32, device=buf.device)
        for bucket in buf.buckets:
            residual = comp.residuals.get(bucket_key(buf, bucket))
            if residual is not None:
                lo, hi, _ = bucket.residual_range()
                placed[bucket.offset + lo : bucket.offset + hi] = residual
        if buf.data_parallel_group is not None:
            comm.all_reduce(
                placed, group=buf.data_parallel_group, kind="grad_compression_pending_all_reduce", stats=buf.comm_stats
            )
        for p, (start, end, _) in buf.param_index_map.items():
            out[p] = placed[start:end].view(p.shape)
    return out


def load_pending(model_chunks: Sequence, pending: Dict[torch.nn.Parameter, torch.Tensor]) -> None:
    """Residuals <- ``P / K'`` of :func:`pending_updates`' tensors (zero for a parameter missing from
    ``pending``); replaces every residual of the compressed buffers.  No communication."""
    for comp, buf in compressed_buffers(model_chunks):
        placed = torch.zeros(buf.numel, dtype=torch.float32, device=buf.device)
        for p, (start, end, _) in buf.param_index_map.items():
            if p in pending:
                placed[start:end] = pending[p].reshape(-1).to(placed.device, torch.float32)
        for bucket in buf.buckets:
            lo, hi, ranks = bucket.residual_range()
            part = placed[bucket.offset + lo : bucket.offset + hi]
            comp.residuals[bucket_key(buf, bucket)] = part / ranks if ranks > 1 else part.clone()


def _matrices(comp, buf, bucket) -> Iterator[Tuple[str, tuple, Tuple[int, int]]]:
    """``(Q key, (parameter, first row, end row), Q shape)`` of each matrix PowerSGD compresses in
    ``bucket`` (what this rank's residual covers) with this run's ``--powersgd-rank``."""
    if not bucket.compresses():
        return
    lo, hi, _ = bucket.residual_range()
    for i, seg in enumerate(bucket.matrices(lo, hi)):
        r = powersgd.compressed_rank(seg, comp.method.rank)
        start = seg.start + lo  # bucket coordinates
        for p, (ps, pe) in bucket.param_ranges.items():
            if r > 0 and ps <= start < pe:
                first = (start - ps) // seg.shape[1]
                yield f"{bucket_key(buf, bucket)}/{i}", (p, first, first + seg.shape[0]), (seg.shape[1], r)
                break


def _powersgd_buffers(model_chunks: Sequence):
    return [(c, b) for c, b in compressed_buffers(model_chunks) if isinstance(c.method, powersgd.PowerSGD)]


def powersgd_qs(model_chunks: Sequence) -> Dict[tuple, torch.Tensor]:
    """``{(parameter, first row, end row): Q}`` of the PowerSGD matrices this rank has a ``Q`` for."""
    out = {}
    for comp, buf in _powersgd_buffers(model_chunks):
        for bucket in buf.buckets:
            for key, where, _ in _matrices(comp, buf, bucket):
                if key in comp.method.qs:
                    out[where] = comp.method.qs[key]
    return out


def powersgd_q_shapes(model_chunks: Sequence) -> Dict[tuple, Tuple[int, int]]:
    """``{(parameter, first row, end row): Q shape}`` of every matrix this run compresses with PowerSGD."""
    return {where: shape for comp, buf in _powersgd_buffers(model_chunks) for b in buf.buckets
            for _, where, shape in _matrices(comp, buf, b)}  # fmt: skip


def load_powersgd_qs(model_chunks: Sequence, qs: Dict[tuple, torch.Tensor]) -> int:
    """Put the ``Q`` of each ``(parameter, rows)`` of ``qs`` where this run compresses the same rows
    with a ``Q`` of the same shape; returns how many were copied."""
    copied = 0
    for comp, buf in _powersgd_buffers(model_chunks):
        for bucket in buf.buckets:
            for key, where, shape in _matrices(comp, buf, bucket):
                q = qs.get(where)
                if q is not None and tuple(q.shape) == shape:
                    comp.method.qs[key] = q.to(buf.device, torch.float32).clone()
                    copied += 1
    return copied
