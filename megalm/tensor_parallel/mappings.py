"""Autograd-aware communication over a process group given by the caller.

Each function is a pair of collectives: one in forward and its adjoint in backward.  Every
function takes the ``group`` it communicates over (a ``torch.distributed`` process group, or
``None`` for a group of this rank alone) and is the identity when the group's size is one
(nothing is sent then).  Nothing here reads :mod:`megalm.parallel_state`: layers pass their
tensor-parallel group, the MoE token dispatcher passes its expert-parallel group (the dim-0
all-gather / reduce-scatter pair is the same collective over another group).

Tensor-parallel splits ("model parallel region") are along the last dimension; sequence
parallel splits are along dimension 0 (activations are ``[s, b, h]``).

In-place reductions: ``all_reduce`` has no out-of-place form, so a reduction either clones
its operand or overwrites it.  :func:`reduce_from_tensor_model_parallel_region` and
:func:`copy_to_tensor_model_parallel_region` take ``in_place``: the caller states that the
tensor it reduces is its own temporary (forward: nothing else uses or saved the input, e.g.
a fresh matmul output; backward: the output's gradient reaches no other input, e.g. it feeds
one matmul).  Without it they clone, because autograd hands the *same* gradient tensor to
both inputs of an addition, so reducing it in place would corrupt the other branch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.utils import all_gather_flat, divide, reduce_scatter_flat

# --- raw collectives (no autograd) -----------------------------------------------------


def all_reduce(x: torch.Tensor, group, async_op: bool = False):
    """In-place sum of ``x`` (contiguous) over ``group``; returns ``(x, handle)`` (handle None when
    sync or size 1)."""
    if group_size(group) == 1:
        return x, None
    return x, dist.all_reduce(x, group=group, async_op=async_op)


def split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of the last dimension (local, sends nothing)."""
    size = group_size(group)
    if size == 1:
        return x
    local = divide(x.shape[-1], size)
    return x.narrow(-1, group_rank(group) * local, local).contiguous()


def gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dimension, in group-rank order."""
    size = group_size(group)
    if size == 1:
        return x
    out = all_gather_first_dim(x, group)[0]
    return torch.cat(torch.chunk(out, size, dim=0), dim=-1).contiguous()


def split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of dimension 0 (local, sends nothing)."""
    size = group_size(group)
    if size == 1:
        return x
    local = divide(x.shape[0], size)
    return x.narrow(0, group_rank(group) * local, local).contiguous()


def all_gather_first_dim(x: torch.Tensor, group, async_op: bool = False):
    """All-gather along dim 0 over ``group``; returns ``(output, handle)`` (handle None when sync or size 1)."""
    size = group_size(group)
    if size == 1:
        return x, None
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = all_gather_flat(out, x, group=group, async_op=async_op)
    return out, handle


def reduce_scatter_first_dim(x: torch.Tensor, group, async_op: bool = False):
    """Sum over ``group`` and keep this rank's dim-0 slice; returns ``(output, handle)``."""
    size = group_size(group)
    if size == 1:
        return x, None
    x = x.contiguous()
    out = torch.empty((divide(x.shape[0], size),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = reduce_scatter_flat(out, x, group=group, async_op=async_op)
    return out, handle


# --- autograd functions ----------------------------------------------------------------


def _reduce_owned(x: torch.Tensor, group, in_place: bool) -> torch.Tensor:
    """Sum over ``group``: in ``x`` itself when ``in_place`` and contiguous, else in a copy."""
    if group_size(group) == 1:
        return x
    target = x if in_place and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
    return all_reduce(target, group)[0]


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_place):
        ctx.group, ctx.in_place = group, in_place
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce_owned(grad, ctx.group, ctx.in_place), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_place):
        if in_place and x.is_contiguous() and group_size(group) > 1:
            ctx.mark_dirty(x)
        return _reduce_owned(x, group, in_place)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group)[0], None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.tensor_parallel_output_grad = group, tensor_parallel_output_grad
        return all_gather_first_dim(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_first_dim(grad, ctx.group)[0], None, None
        return split_first_dim(grad, ctx.group), None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first_dim(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group)[0], None


# --- public API --------------------------------------------------------------------------


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group, in_place: bool = False) -> torch.Tensor:
    """Enter a TP region with a replicated input.

    Forward: identity (sends nothing).  Backward: all-reduce (sum) of the input gradient
    over ``group``, since every rank's partial computation contributed to it; in the incoming
    gradient itself with ``in_place`` (only when the output feeds nothing else, see the module
    docstring), else in a copy.
    """
    return _CopyToRegion.apply(x, group, in_place)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group, in_place: bool = False) -> torch.Tensor:
    """Leave a TP region by summing partial results.

    Forward: all-reduce (sum) over ``group``; with ``in_place`` in ``x`` itself (marked dirty;
    only for a temporary nothing else uses or saved for backward), else in a copy.
    Backward: identity (the gradient is replicated).
    """
    return _ReduceFromRegion.apply(x, group, in_place)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension.

    Forward: local split, sends nothing.  Backward: all-gather of the gradient along the
    last dimension over ``group``.
    """
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's last-dimension slice.

    Forward: all-gather along the last dimension over ``group``.  Backward: local split of the
    gradient (keeps this rank's slice, sends nothing).
    """
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0) of a replicated tensor.

    Forward: local split, sends nothing.  Backward: all-gather of the gradient along dim 0.
    """
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """Reassemble the full dim 0 (sequence, or the tokens of an expert-parallel group) from
    every rank's slice.

    Forward: all-gather along dim 0 over ``group``.  Backward: reduce-scatter along dim 0 when
    every rank's use of the output contributes to each slice's gradient (the default: a TP
    region, or experts applied to gathered tokens), else a local split (the gradient is
    already replicated).
    """
    return _GatherFromSequence.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Sum partial results over ``group`` and keep this rank's slice of dim 0.

    Forward: reduce-scatter along dim 0.  Backward: all-gather of the gradient along dim 0.
    """
    return _ReduceScatterToSequence.apply(x, group)
