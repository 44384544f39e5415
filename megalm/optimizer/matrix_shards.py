"""Whole (TP-local) matrices from the distributed optimizer's flat ranges, for Muon.

Under ``--use-distributed-optimizer`` each data-parallel rank owns one flat range ``[start, end)``
of a parameter's TP-local tensor (or none).  Newton-Schulz needs the whole matrix, so
:meth:`MatrixShards.assemble` writes this rank's ranges of every Muon matrix into one zeroed
flat buffer (the matrices of this stage one after the other, the same order on every rank) and
SUM-all-reduces it ONCE over the data-parallel (x context) group: each element is owned by
exactly one rank, so the sum is the assembled matrices, on every rank (``2 (K-1)/K`` of the
matrices' fp32 bytes per rank per step).  :meth:`MatrixShards.range_of` cuts a rank's range back
out of a whole update.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megalm.device import get_device
from megalm.distributed import comm


class MatrixShards:
    """Args:
    matrices: ``[(index, model param)]`` of every Muon matrix of this stage (same order on every rank).
    owned: ``{id(main range): (index, start, end)}`` for this rank's ranges.
    group: the data-parallel (x context) group the ranges are spread over.
    """

    def __init__(self, matrices: List[Tuple[int, torch.nn.Parameter]], owned: Dict[int, Tuple[int, int, int]], group):
        self.matrices = matrices
        self.owned = owned
        self.group = group
        self.offset: Dict[int, int] = {}
        total = 0
        for index, param in matrices:
            self.offset[index] = total
            total += param.numel()
        self.total = total

    def assemble(self, pieces: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """``{id(main range): 1-D piece}`` of this rank -> ``{index: whole TP-local matrix}`` (fp32) of
        every Muon matrix; one SUM all-reduce over the group (every rank calls it, holding pieces or not)."""
        device = next(iter(pieces.values())).device if pieces else get_device()
        flat = torch.zeros(self.total, dtype=torch.float32, device=device)
        for key, piece in pieces.items():
            index, start, end = self.owned[key]
            at = self.offset[index]
            flat[at + start : at + end] = piece
        comm.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, kind="muon_matrix_all_reduce")
        return {
            index: flat[self.offset[index] : self.offset[index] + param.numel()].view(param.shape)
            for index, param in self.matrices
        }

    def range_of(self, key: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's flat range ``[start, end)`` of ``whole`` (the TP-local matrix of the range ``key``)."""
        _, start, end = self.owned[key]
        return whole.reshape(-1)[start:end]
