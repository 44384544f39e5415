"""Whole (TP-local) matrices from the distributed optimizer's flat ranges, for Muon.

Under ``--use-distributed-optimizer`` each data-parallel rank owns one flat range ``[start, end)``
of a parameter's TP-local tensor (or none).  Newton-Schulz needs the whole matrix, so
:meth:`MatrixShards.assemble` writes this rank's ranges of every Muon matrix into a zeroed flat
buffer (the matrices of this stage one after the other, the same order on every rank) and
SUM-all-reduces it ONCE over the group the ranges are spread over: each element is owned by
exactly one rank, so the sum is the assembled matrices, on every rank (``2 (K-1)/K`` of the
matrices' fp32 bytes per rank per step).  Dense matrices are spread over the data-parallel (x
context) group; MoE expert matrices (whole on their expert-parallel rank, sharded by the expert
buffers) over the expert-data-parallel group, the ranks holding the same experts: a second flat
buffer and a second all-reduce, over that group.  :meth:`MatrixShards.range_of` cuts a rank's
range back out of a whole update.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megalm.device import get_device
from megalm.distributed import comm
from megalm.tensor_parallel.param_info import param_info


class MatrixShards:
    """Args:
    matrices: ``[(index, model param)]`` of every Muon matrix of this stage (same order on every rank).
    owned: ``{id(main range): (index, start, end)}`` for this rank's ranges (the id of the tensor the
        torch optimizer updates: the range's host copy under ``--optimizer-cpu-offload``).
    group: the data-parallel (x context) group the dense ranges are spread over.
    expert_group: the expert-data-parallel group the expert ranges are spread over.
    """

    def __init__(
        self,
        matrices: List[Tuple[int, torch.nn.Parameter]],
        owned: Dict[int, Tuple[int, int, int]],
        group,
        expert_group=None,
        comm_stats: Optional[comm.CommStats] = None,
    ):
        self.comm_stats = comm_stats  # where the all-reduces are counted (None: not counted)
        self.matrices = matrices
        self.owned = owned
        self.groups = (group, expert_group)
        self.part: Dict[int, int] = {}  # index -> 0 (dense) or 1 (expert)
        self.offset: Dict[int, int] = {}
        self.totals = [0, 0]
        for index, param in matrices:
            part = int(param_info(param).expert)
            self.part[index], self.offset[index] = part, self.totals[part]
            self.totals[part] += param.numel()

    def assemble(self, pieces: Dict[int, torch.Tensor]) -> Dict[int, torch.Tensor]:
        """``{id(main range): 1-D piece}`` of this rank -> ``{index: whole TP-local matrix}`` (fp32) of
        every Muon matrix; one SUM all-reduce per part (dense over the data-parallel group, experts over
        the expert-data-parallel group) that has matrices; every rank of a group calls it, holding
        pieces or not."""
        flats = [torch.zeros(total, dtype=torch.float32, device=get_device()) for total in self.totals]
        for key, piece in pieces.items():
            index, start, end = self.owned[key]
            at = self.offset[index]
            flats[self.part[index]][at + start : at + end] = piece
        for flat, group, kind in zip(flats, self.groups, ("muon_matrix_all_reduce", "muon_expert_matrix_all_reduce")):
            if flat.numel():
                comm.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, kind=kind, stats=self.comm_stats)
        return {
            index: flats[self.part[index]][self.offset[index] : self.offset[index] + param.numel()].view(param.shape)
            for index, param in self.matrices
        }

    def range_of(self, key: int, whole: torch.Tensor) -> torch.Tensor:
        """This rank's flat range ``[start, end)`` of ``whole`` (the TP-local matrix of the range ``key``)."""
        _, start, end = self.owned[key]
        return whole.reshape(-1)[start:end]
