"""Gradient compression with error feedback for the data-parallel reduction (``--grad-compression``).

:func:`build_compressor` turns the flags into a :class:`~.error_feedback.GradCompressor` that
:class:`megalm.distributed.DistributedDataParallel` hands to its gradient buffers; each bucket
then reduces through :meth:`GradCompressor.all_reduce` instead of the exact all-reduce (with
``--hierarchical-grad-reduce`` only the inter-node leg), or with the distributed optimizer through
:meth:`GradCompressor.reduce_scatter` (int8: an all-to-all; the others: the all-reduce, then the
shard).  Methods: :mod:`.powersgd`, :mod:`.topk`, :mod:`.int8`, :mod:`.int4`, :mod:`.fp8`; error feedback and the
stage chain: :mod:`.error_feedback`; carrying it across a change of layout: :mod:`.reshard`.
"""

from __future__ import annotations

from typing import Optional

from megalm.distributed.compression.error_feedback import CompressionJob, GradCompressor
from megalm.distributed.compression.fp8 import FP8
from megalm.distributed.compression.int4 import Int4
from megalm.distributed.compression.int8 import Int8
from megalm.distributed.compression.powersgd import PowerSGD
from megalm.distributed.compression.segments import Segment, matrix_segments
from megalm.distributed.compression.topk import TopK

METHODS = ("none", "powersgd", "topk", "int8", "int4", "fp8")


def build_compressor(parallel_cfg, device=None, rank: int = 0, comm_stats=None) -> Optional[GradCompressor]:
    """The compressor the flags ask for, or None (``--grad-compression none``).  ``rank``: this
    process's global rank, seeding stochastic rounding (a different stream per rank); ``comm_stats``:
    the :class:`megalm.distributed.comm.CommStats` its collectives are counted in (None: not counted)."""
    name = parallel_cfg.grad_compression
    if name == "none":
        return None
    if name == "powersgd":
        method, settings = PowerSGD(parallel_cfg.powersgd_rank), f"rank {parallel_cfg.powersgd_rank}"
    elif name == "topk":
        method, settings = TopK(parallel_cfg.topk_ratio), f"ratio {parallel_cfg.topk_ratio}"
    elif name in ("int8", "int4"):
        stochastic = parallel_cfg.int8_rounding == "stochastic"
        cls = Int8 if name == "int8" else Int4
        method = cls(parallel_cfg.int8_chunk_size, stochastic, seed=1_000_003 + rank, device=device)
        settings = f"chunk {parallel_cfg.int8_chunk_size}, {parallel_cfg.int8_rounding} rounding"
    else:
        chunk, rounding, fmt = (parallel_cfg.grad_fp8_chunk_size, parallel_cfg.grad_fp8_rounding,
                                parallel_cfg.grad_fp8_format)  # fmt: skip
        method = FP8(chunk, rounding == "stochastic", fmt, seed=1_000_003 + rank, device=device)
        settings = f"{fmt}, chunk {chunk}, {rounding} rounding"
    return GradCompressor(method, f"{name} ({settings})", comm_stats)


__all__ = [
    "CompressionJob",
    "FP8",
    "GradCompressor",
    "Int4",
    "Int8",
    "METHODS",
    "PowerSGD",
    "Segment",
    "TopK",
    "build_compressor",
    "matrix_segments",
]
