"""The all-to-all over the expert-model-parallel (EP) group, with autograd.

The EP group holds ranks with the same tensor-parallel rank (layout ``tp-ep-edp-pp``), so under
sequence parallelism the ranks of one EP group exchange tokens of the same sequence slice index
of different samples.  The dim-0 all-gather / reduce-scatter pair the ``allgather`` dispatcher
uses is the sequence-parallel one of :mod:`megalm.tensor_parallel.mappings` over the EP group
(:func:`~megalm.tensor_parallel.mappings.gather_from_sequence_parallel_region`,
:func:`~megalm.tensor_parallel.mappings.reduce_scatter_to_sequence_parallel_region`); only the
uneven all-to-all is MoE-specific.  Tokens are ``[T, h]`` (dim 0 is the token).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from megalm.parallel_state import group_size


def all_to_all_ep(x: torch.Tensor, output_splits: List[int], input_splits: List[int], group) -> torch.Tensor:
    """Send rows ``input_splits[r]`` of ``x`` (in order) to rank ``r`` of ``group``; receive
    ``output_splits[r]`` rows from rank ``r``, concatenated in rank order (no autograd)."""
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(
        out, x, output_split_sizes=list(output_splits), input_split_sizes=list(input_splits), group=group
    )
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return all_to_all_ep(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_ep(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all_expert_parallel(
    x: torch.Tensor, output_splits: Optional[List[int]], input_splits: Optional[List[int]], group
) -> torch.Tensor:
    """Forward: ``all_to_all_single`` over ``group`` (the EP group) with the given (uneven) splits.
    Backward: the reverse all-to-all of the gradient (splits swapped)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)
