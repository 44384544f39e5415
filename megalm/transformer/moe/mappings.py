"""Autograd-aware collectives over the expert-model-parallel (EP) group.

Every function is a forward collective paired with its adjoint in backward, and is the
identity (no process group touched) when the EP size is one.  The EP group holds ranks with
the same tensor-parallel rank (layout ``tp-ep-edp-pp``), so under sequence parallelism the
ranks of one EP group exchange tokens of the same sequence slice index of different samples.

Shapes: tokens are ``[T, h]`` (dim 0 is the token), every EP rank holding the same ``T``
for the gather / reduce-scatter pair (equal micro-batches); the all-to-all takes uneven splits.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.tensor_parallel.utils import all_gather_flat, reduce_scatter_flat


def ep_size() -> int:
    return parallel_state.get_expert_model_parallel_world_size()


def ep_rank() -> int:
    return parallel_state.get_expert_model_parallel_rank()


def _group():
    return parallel_state.get_expert_model_parallel_group()


# --- raw collectives ---------------------------------------------------------------------

def all_gather_ep(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every EP rank's ``x`` along dim 0, in EP-rank order (no autograd)."""
    size = ep_size()
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x, group=_group())
    return out


def reduce_scatter_ep(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over EP ranks and keep this rank's dim-0 block (no autograd)."""
    size = ep_size()
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_flat(out, x, group=_group())
    return out


def all_to_all_ep(x: torch.Tensor, output_splits: List[int], input_splits: List[int]) -> torch.Tensor:
    """Send rows ``input_splits[r]`` of ``x`` (in order) to EP rank ``r``; receive ``output_splits[r]``
    rows from rank ``r``, concatenated in rank order (no autograd)."""
    if ep_size() == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=list(output_splits), input_split_sizes=list(input_splits),
                           group=_group())
    return out


# --- autograd functions ----------------------------------------------------------------------

class _GatherFromExpertParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return all_gather_ep(x)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_ep(grad)


class _ReduceScatterToExpertParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_ep(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_ep(grad)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits):
        ctx.output_splits, ctx.input_splits = output_splits, input_splits
        return all_to_all_ep(x, output_splits, input_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_ep(grad, ctx.input_splits, ctx.output_splits), None, None


def gather_from_expert_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward: all-gather along dim 0 over EP (``[T, ...]`` -> ``[EP*T, ...]``).
    Backward: reduce-scatter of the gradient along dim 0 (every rank's experts contributed to
    the gradient of every gathered token; each rank keeps the sum for its own tokens)."""
    return _GatherFromExpertParallel.apply(x)


def reduce_scatter_to_expert_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Forward: sum over EP and keep this rank's dim-0 block (``[EP*T, h]`` -> ``[T, h]``).
    Backward: all-gather of the gradient along dim 0."""
    return _ReduceScatterToExpertParallel.apply(x)


def all_to_all_expert_parallel(x: torch.Tensor, output_splits: Optional[List[int]],
                               input_splits: Optional[List[int]]) -> torch.Tensor:
    """Forward: ``all_to_all_single`` over EP with the given (uneven) splits.
    Backward: the reverse all-to-all of the gradient (splits swapped)."""
    if ep_size() == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits))
