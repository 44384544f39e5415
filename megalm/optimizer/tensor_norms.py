"""Squared L2 norms of FULL parameter tensors from the pieces a rank holds (layer-wise optimizers).

LAMB's and LARS' trust ratios need ``||w||`` and ``||update||`` of each whole parameter.  A rank
may hold only a piece of it:

* tensor parallelism: a TP-split parameter (``ParamInfo.tensor_parallel``) is cut over the TP
  ranks, so its squared norm is the SUM of the TP ranks' pieces; a replicated parameter is whole
  on every TP rank and counts on TP rank 0 only;
* the distributed optimizer: each data-parallel rank updates one flat range of the TP-local
  tensor (or none), so the squared norm is also summed over the data-parallel (x context) ranks;
* pipeline parallelism: a parameter lives on one stage; nothing to do;
* expert parallelism: an expert parameter is whole on its EP rank (never TP-split, the same on
  every TP rank) and, under the distributed optimizer, cut into flat ranges over the
  expert-data-parallel ranks, which hold the same experts; ranks of another EP rank hold other
  experts at the same local index.  Its row is therefore offset by its EP rank (rows
  ``num_params (1 + ep_rank) + index``), so the one SUM over the stage adds only the pieces of the
  same expert tensor (the table grows to ``(1 + EP) num_params`` rows; still one all-reduce).

:class:`FullTensorNorms` keeps, for each main parameter the torch optimizer updates, the index
of its model parameter in the wrapper's (stage-wide, rank-independent) list.  One call: the
local ``sum x^2`` of a parameter's two pieces (weight, update) go into row ``index`` of a
``[num model params, 2]`` fp32 table (TP duplicates zeroed off TP rank 0; expert rows offset as
above), the table is SUM-all-reduced ONCE over the group that cuts the tensors (``tp``;
``tp_dp_cp`` for the distributed optimizer), and each main parameter reads its row back.  8 bytes
per model parameter (``8 (1 + EP)`` with experts) per step; every rank of the group calls it once
per step, even holding no piece.  :class:`LocalTensorNorms` is the single-process default (no
communication).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm.device import get_device
from megalm.distributed import comm
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.param_info import param_info


def _sum_squares(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], device) -> torch.Tensor:
    """``[len(a), 2]`` fp32 on ``device``: ``sum x^2`` of ``a[i]`` and of ``b[i]`` (each norm taken where
    its tensor is: offloaded host copies on the host, 4 bytes each to ``device``)."""
    flat = [t.float() if t.dtype != torch.float32 else t for t in list(a) + list(b)]
    if not flat:
        return torch.zeros((0, 2), dtype=torch.float32, device=device)
    return torch.stack(_norms(flat, device)).pow(2).reshape(2, len(a)).t()


def _norms(tensors: List[torch.Tensor], device) -> List[torch.Tensor]:
    """L2 norm of each tensor, on ``device``: one ``_foreach_norm`` per device the tensors are on."""
    out: List[torch.Tensor] = [torch.empty(0)] * len(tensors)
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for indices in by_device.values():
        for i, n in zip(indices, torch._foreach_norm([tensors[i] for i in indices])):
            out[i] = n.to(device)
    return out


class LocalTensorNorms:
    """Every main parameter is a whole tensor (one process): the local norms."""

    def __call__(
        self, params: Sequence[torch.Tensor], a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Squared L2 norms of ``a[i]`` and ``b[i]`` (two tensors of parameter ``i``), each ``[len(params)]``."""
        sq = _sum_squares(a, b, params[0].device if params else None)
        return sq[:, 0], sq[:, 1]


class FullTensorNorms:
    """Squared norms of the full tensors (see the module docstring).

    Args:
        owners: ``[(main param, index of its model param, model param)]`` for every main
            parameter of this rank; indices in ``range(num_params)``, the same on every rank of
            ``group`` for the same model parameter.
        num_params: number of model parameters (rows of the table).
        group: the ranks whose pieces make up the tensors (size > 1).
        tp_group: decides the duplicates (replicated params count on TP rank 0 only).
        ep_group: the expert-parallel group (expert rows are offset by its rank).
    """

    def __init__(
        self,
        owners: List[Tuple[torch.Tensor, int, torch.Tensor]],
        num_params: int,
        group,
        tp_group,
        ep_group=None,
        comm_stats: Optional[comm.CommStats] = None,
    ):
        self.comm_stats = comm_stats
        self.rows = num_params * (1 + group_size(ep_group))  # dense rows, then one block per EP rank
        self.group = group
        keep_duplicates = group_rank(tp_group) == 0
        expert_offset = num_params * (1 + group_rank(ep_group))
        self.row: Dict[int, int] = {}
        self.counts: Dict[int, bool] = {}
        for main, index, model in owners:
            info = param_info(model)
            self.row[id(main)] = index + (expert_offset if info.expert else 0)
            self.counts[id(main)] = info.tensor_parallel or keep_duplicates

    def __call__(
        self, params: Sequence[torch.Tensor], a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Squared L2 norms of the full tensors of which ``a[i]``, ``b[i]`` are this rank's pieces;
        one SUM all-reduce of a ``[rows, 2]`` fp32 table over the group."""
        local = _sum_squares(a, b, get_device())  # where the all-reduce runs; a rank holding no piece takes part
        table = torch.zeros((self.rows, 2), dtype=torch.float32, device=local.device)
        rows = torch.tensor([self.row[id(p)] for p in params], dtype=torch.long, device=local.device)
        if params:
            weight = torch.tensor([float(self.counts[id(p)]) for p in params], device=local.device)
            table.index_add_(0, rows, local * weight[:, None])
        comm.all_reduce(
            table, op=dist.ReduceOp.SUM, group=self.group, kind="tensor_norms_all_reduce", stats=self.comm_stats
        )
        full = table[rows]
        return full[:, 0], full[:, 1]


def build_tensor_norms(owners, num_params: int, group, tp_group, ep_group=None, comm_stats=None):
    """:class:`FullTensorNorms` when ``group`` holds more than this rank, else :class:`LocalTensorNorms`;
    ``comm_stats``: where the all-reduce is counted (None: not counted)."""
    if group_size(group) <= 1:
        return LocalTensorNorms()
    return FullTensorNorms(owners, num_params, group, tp_group, ep_group, comm_stats)
