"""Autograd-aware communication between tensor-parallel ranks.

Each function is a pair of collectives: one in forward and its adjoint in backward.  All
of them communicate over the tensor-model-parallel group and are the identity when the
tensor-parallel size is one (no process group is touched then).

Tensor-parallel splits ("model parallel region") are along the last dimension; sequence
parallel splits are along dimension 0 (activations are ``[s, b, h]``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalm import parallel_state
from megalm.tensor_parallel.utils import all_gather_flat, divide, reduce_scatter_flat


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def _group():
    return parallel_state.get_tensor_model_parallel_group()


# --- raw collectives (no autograd) -----------------------------------------------------

def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=_group())
    return x


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    size = _tp_size()
    if size == 1:
        return x
    local = divide(x.shape[-1], size)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return x.narrow(-1, rank * local, local).contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    size = _tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_flat(out, x, group=_group())
    return torch.cat(torch.chunk(out, size, dim=0), dim=-1).contiguous()


def _split_first_dim(x: torch.Tensor) -> torch.Tensor:
    size = _tp_size()
    if size == 1:
        return x
    local = divide(x.shape[0], size)
    rank = parallel_state.get_tensor_model_parallel_rank()
    return x.narrow(0, rank * local, local).contiguous()


def all_gather_first_dim(x: torch.Tensor, async_op: bool = False):
    """All-gather along dim 0 over TP; returns ``(output, handle)`` (handle None when sync or tp 1)."""
    size = _tp_size()
    if size == 1:
        return x, None
    x = x.contiguous()
    out = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = all_gather_flat(out, x, group=_group(), async_op=async_op)
    return out, handle


def reduce_scatter_first_dim(x: torch.Tensor, async_op: bool = False):
    """Sum over TP and keep this rank's dim-0 slice; returns ``(output, handle)``."""
    size = _tp_size()
    if size == 1:
        return x, None
    x = x.contiguous()
    out = torch.empty((divide(x.shape[0], size),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    handle = reduce_scatter_flat(out, x, group=_group(), async_op=async_op)
    return out, handle


def all_reduce_tp(x: torch.Tensor, async_op: bool = False):
    """In-place sum over TP; returns ``(x, handle)``."""
    if _tp_size() == 1:
        return x, None
    handle = dist.all_reduce(x, group=_group(), async_op=async_op)
    return x, handle


# --- autograd functions ----------------------------------------------------------------

class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone() if _tp_size() > 1 else grad)


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone() if _tp_size() > 1 else x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_first_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad)[0]


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tensor_parallel_output_grad):
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return all_gather_first_dim(x)[0]

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_first_dim(grad)[0], None
        return _split_first_dim(grad), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return reduce_scatter_first_dim(x)[0]

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad)[0]


# --- public API --------------------------------------------------------------------------

def copy_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Enter a TP region with a replicated input.

    Forward: identity (sends nothing).  Backward: all-reduce (sum) of the input gradient
    over TP, since every rank's partial computation contributed to it.
    """
    return _CopyToRegion.apply(x)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Leave a TP region by summing partial results.

    Forward: all-reduce (sum) over TP.  Backward: identity (the gradient is replicated).
    """
    return _ReduceFromRegion.apply(x)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dimension.

    Forward: local split, sends nothing.  Backward: all-gather of the gradient along the
    last dimension.
    """
    return _ScatterToRegion.apply(x)


def gather_from_tensor_model_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's last-dimension slice.

    Forward: all-gather along the last dimension.  Backward: local split of the gradient
    (keeps this rank's slice, sends nothing).
    """
    return _GatherFromRegion.apply(x)


def scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0) of a replicated tensor.

    Forward: local split, sends nothing.  Backward: all-gather of the gradient along dim 0.
    """
    return _ScatterToSequence.apply(x)


def gather_from_sequence_parallel_region(x: torch.Tensor, tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """Reassemble the full sequence from every rank's dim-0 slice.

    Forward: all-gather along dim 0.  Backward: reduce-scatter along dim 0 when the output
    feeds a TP region (each rank's gradient is partial, the default), else a local split
    (the gradient is already replicated).
    """
    return _GatherFromSequence.apply(x, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results over TP and keep this rank's slice of the sequence.

    Forward: reduce-scatter along dim 0.  Backward: all-gather of the gradient along dim 0.
    """
    return _ReduceScatterToSequence.apply(x)
