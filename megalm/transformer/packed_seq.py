"""Packed sequences in THD form (``--qkv-format thd`` with ``--reset-attention-mask``): Megatron-core's
``PackedSeqParams``.

A micro-batch of ``b`` rows of ``s`` tokens is read as one packed sequence of ``t = b s`` tokens in
row-major order (token ``p`` of row ``r`` is token ``r s + p``).  Its documents (a document ends at, and
includes, an end-of-document token; a row's end also ends one) are the segments
``[cu_seqlens[i], cu_seqlens[i + 1])``; attention runs within each segment, causal, and nothing else
is computed or stored: no ``[b, 1, s, s]`` mask (:mod:`megalm.transformer.varlen_attention`).  RoPE
positions restart at 0 in every segment (:func:`positions_in_segments`), as Transformer Engine's THD
RoPE does.  The queries' and keys' segments are the same (self-attention): ``cu_seqlens_kv`` is
``cu_seqlens_q``.

Every rank builds the parameters from the document ids :func:`megalm.data.batch.get_batch_on_this_tp_rank`
delivers (every pipeline stage receives them); no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from megalm.errors import MegalmError


class PackedSequenceError(MegalmError, ValueError):
    """Packed-sequence parameters that do not describe the batch they are used with."""


@dataclass(frozen=True)
class PackedSeqParams:
    """Megatron-core's ``PackedSeqParams`` for self-attention: ``cu_seqlens_q`` (int32 ``[segments + 1]``,
    from 0 to ``t``) on the model's device, ``max_seqlen_q`` the longest segment; the ``_kv`` fields are
    the same tensors.  ``batch_shape``: ``(b, s)``, the rows the packed sequence was made of."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    batch_shape: Tuple[int, int]
    qkv_format: str = "thd"

    def segments(self) -> List[Tuple[int, int]]:
        """``(start, end)`` of every segment in packed order (one host copy of ``cu_seqlens_q``)."""
        bounds = self.cu_seqlens_q.tolist()
        return list(zip(bounds[:-1], bounds[1:]))

    def check(self, s: int, b: int) -> None:
        """Raise unless these parameters pack ``b`` rows of ``s`` tokens."""
        if tuple(self.batch_shape) != (b, s):
            raise PackedSequenceError(
                f"packed-sequence parameters for {self.batch_shape[0]} rows of {self.batch_shape[1]} tokens "
                f"given a batch of {b} rows of {s}"
            )


def packed_seq_params_from_documents(document_ids: torch.Tensor) -> PackedSeqParams:
    """``document_ids`` ``[b, s]`` (non-decreasing per row, :func:`megalm.data.gpt_dataset.document_ids`) ->
    the segments of the packed ``b s`` tokens: one per document of each row."""
    if document_ids.dim() != 2:
        raise PackedSequenceError(f"document ids must be [b, s], got shape {tuple(document_ids.shape)}")
    b, s = document_ids.shape
    starts = torch.ones(b, s, dtype=torch.bool, device=document_ids.device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    begin = starts.reshape(-1).nonzero().flatten()
    cu = torch.cat([begin, begin.new_tensor([b * s])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(cu, cu, longest, longest, (b, s))


def positions_in_segments(params: PackedSeqParams) -> torch.Tensor:
    """Each token's position within its segment, int64 ``[b, s]``: RoPE's positions under THD."""
    b, s = params.batch_shape
    cu = params.cu_seqlens_q.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=b * s)
    return (torch.arange(b * s, device=cu.device) - starts).view(b, s)


def document_ids(params: PackedSeqParams) -> torch.Tensor:
    """Each token's segment index in packed order, int64 ``[b, s]`` (the allgather CP core's document mask)."""
    b, s = params.batch_shape
    cu = params.cu_seqlens_q.to(torch.int64)
    segments = torch.arange(cu.numel() - 1, device=cu.device)
    return torch.repeat_interleave(segments, cu[1:] - cu[:-1], output_size=b * s).view(b, s)
