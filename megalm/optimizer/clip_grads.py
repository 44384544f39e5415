"""Global gradient norm, clipping, zero counting and overflow detection across model-parallel ranks.

Which gradients count in the norm (each distinct gradient exactly once over the model replica):

* tensor-parallel duplicates: a parameter with ``tensor_model_parallel`` False is replicated on
  every TP rank, so it counts only on TP rank 0 (an expert's, with ETP > 1: on ETP rank 0);
* the tied embedding copy on the last pipeline stage (``param.shared``, or
  ``param.shared_embedding`` on a stage other than the first) is not counted: its gradient equals
  the first stage's after the embedding all-reduce.

Communication (the groups come from a :class:`megalm.parallel_state.ProcessGroups` passed in):
``||g||^2`` (and the zero count)
are summed with one all-reduce over the model-parallel group ``mp`` (TP x PP); with expert
parallelism (EP > 1) or split experts (ETP > 1) the expert parameters' (``allreduce`` False) part
is summed over ``tp_ep_pp`` (TP x EP x PP; ETP x EP x PP) by a second all-reduce: each ETP shard of
an expert is a different gradient there (``tensor_parallel``, counted on every rank).  Overflow
flags are MAX-reduced over ``mp`` (the world with EP or ETP > 1, so that ranks sharing dense
parameters always take the same decision).

Sharded gradients (the distributed optimizer: each data-parallel rank holds a disjoint shard
of every gradient, ``sharded=True``): the local sums of squares are summed with ONE all-reduce
over the world.  That is the DP-then-model-parallel sum: the world is the product of the
data-parallel (x context) group and the model-parallel group for dense parameters, and of the
expert-data-parallel group and the expert-model-parallel group for expert parameters, each
element of each distinct gradient lives on exactly one rank of it, and the duplicates above are
excluded before summing.  The overflow flag is MAX-reduced over the world as well.

Clipping (as torch.nn.utils.clip_grad_norm_ and Megatron): ``g *= max_norm / (norm + 1e-6)``
when that factor is < 1.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megalm.device import get_device
from megalm.distributed import comm
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.tensor_parallel.param_info import param_info


def param_is_not_shared(param: torch.Tensor, groups: ProcessGroups) -> bool:
    if getattr(param, "shared", False):
        return False
    if param_info(param).tied:
        return group_rank(groups.pp) == 0  # the first pipeline stage's copy counts
    return True


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, groups: ProcessGroups) -> bool:
    """A replicated parameter counts on rank 0 of the group it is replicated over: TP, or for an expert
    parameter with experts split (ETP > 1) the expert-tensor-parallel group."""
    info = param_info(param)
    if info.tensor_parallel:
        return True
    group = groups.etp if info.expert and group_size(groups.etp) > 1 else groups.tp
    return group_rank(group) == 0


def param_counts_in_norm(param: torch.Tensor, groups: ProcessGroups) -> bool:
    return param_is_not_shared(param, groups) and param_is_not_tensor_parallel_duplicate(param, groups)


def is_expert_param(param: torch.Tensor) -> bool:
    return param_info(param).expert


def experts_apart(groups: ProcessGroups) -> bool:
    """Whether expert parameters live on other ranks than the model-parallel group's (EP or ETP > 1)."""
    return group_size(groups.ep) > 1 or group_size(groups.etp) > 1


def _communicating(group) -> Optional[object]:
    """``group`` when it holds more than this rank, else None (nothing to reduce)."""
    return group if group_size(group) > 1 else None


def world_group(groups: ProcessGroups) -> Optional[object]:
    """Every rank of the layout (data x context x model parallel; the same ranks as expert data x
    expert model parallel), or None for a single process."""
    return dist.group.WORLD if group_size(groups.dp_cp) * group_size(groups.mp) > 1 else None


def _all_reduce(t: torch.Tensor, op, group, kind: str, stats: Optional[comm.CommStats]) -> None:
    """All-reduce unless ``group`` is None (no model parallelism: nothing to reduce)."""
    if group is not None:
        comm.all_reduce(t, op=op, group=group, kind=kind, stats=stats)


def _sum_squares_and_zeros(grads: Sequence[torch.Tensor], count_zeros: bool) -> torch.Tensor:
    """``[sum ||g||^2, zeros]`` as a 2-element fp32 tensor (zeros 0 unless counted)."""
    out = torch.zeros(2, dtype=torch.float32, device=grads[0].device if grads else get_device())
    if grads:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        out[0] = torch.stack(norms).pow(2).sum()
        if count_zeros:
            out[1] = sum((g == 0).sum() for g in grads).float()
    return out


def grad_norm_and_zeros(
    grads_with_params: Sequence[Tuple[torch.Tensor, torch.Tensor]],
    count_zeros: bool = False,
    sharded: bool = False,
    *,
    groups: ProcessGroups,
    comm_stats: Optional[comm.CommStats] = None,
) -> Tuple[float, Optional[float]]:
    """Global L2 norm of the gradients (and number of zero entries) over model-parallel ranks.

    ``grads_with_params``: ``(grad, model_param)`` pairs; the model parameter's attributes
    decide whether the gradient counts (see the module docstring).  ``sharded``: the gradients
    are this rank's data-parallel shards (distributed optimizer): one SUM over the world.
    ``groups``: ``mp`` and, with
    expert parallelism, ``tp_ep_pp`` carry the sums; ``tp`` and ``pp`` ranks pick what counts.
    ``comm_stats``: where the all-reduces are counted (None: not counted).
    """
    counted = [(g, p) for g, p in grads_with_params if g is not None and param_counts_in_norm(p, groups)]
    if sharded:
        stats = _sum_squares_and_zeros([g for g, _ in counted], count_zeros)
        _all_reduce(stats, dist.ReduceOp.SUM, world_group(groups), "grad_norm_all_reduce", comm_stats)
        norm = math.sqrt(stats[0].item()) if stats[0].item() >= 0 else float("nan")
        return norm, (stats[1].item() if count_zeros else None)
    split_expert = experts_apart(groups)
    dense = [g for g, p in counted if not (split_expert and is_expert_param(p))]
    stats = _sum_squares_and_zeros(dense, count_zeros)
    _all_reduce(stats, dist.ReduceOp.SUM, _communicating(groups.mp), "grad_norm_all_reduce", comm_stats)
    if split_expert:
        expert = [g for g, p in counted if is_expert_param(p)]
        e_stats = _sum_squares_and_zeros(expert, count_zeros).to(stats.device)
        _all_reduce(e_stats, dist.ReduceOp.SUM, _communicating(groups.tp_ep_pp), "grad_norm_all_reduce", comm_stats)
        stats = stats + e_stats
    norm = math.sqrt(stats[0].item()) if stats[0].item() >= 0 else float("nan")
    return norm, (stats[1].item() if count_zeros else None)


def params_norm(
    params: Sequence[torch.nn.Parameter], groups: ProcessGroups, comm_stats: Optional[comm.CommStats] = None
) -> float:
    """Global L2 norm of the model parameters, each distinct parameter once (the same
    de-duplication and all-reduces as the gradient norm; parameters are whole on every
    data-parallel rank, so nothing is summed over data parallelism)."""
    return grad_norm_and_zeros([(p.detach(), p) for p in params], groups=groups, comm_stats=comm_stats)[0]


def clip_grads_by_total_norm(grads: List[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when < 1; return the factor."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0 and grads:
        torch._foreach_mul_(grads, coeff)
    return min(coeff, 1.0)


def unscale_and_check_for_inf(
    grads: List[torch.Tensor],
    inv_scale: float,
    sharded: bool = False,
    *,
    groups: ProcessGroups,
    comm_stats: Optional[comm.CommStats] = None,
) -> bool:
    """Multiply ``grads`` by ``inv_scale`` in place; True when any rank saw inf/nan.

    Communication: one MAX all-reduce of a flag over the model-parallel group ``mp`` (the world
    with EP > 1, or with ``sharded`` gradients: each data-parallel rank sees only its shard).
    ``groups``: as :func:`grad_norm_and_zeros`.
    """
    device = grads[0].device if grads else get_device()
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    if grads:
        torch._amp_foreach_non_finite_check_and_unscale_(
            grads, found_inf, torch.full((1,), inv_scale, dtype=torch.float32, device=device)
        )
    if sharded or experts_apart(groups):
        group = world_group(groups)
    else:
        group = _communicating(groups.mp)
    _all_reduce(found_inf, dist.ReduceOp.MAX, group, "found_inf_all_reduce", comm_stats)
    return bool(found_inf.item() > 0)
