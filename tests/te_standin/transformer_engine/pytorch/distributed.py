"""Stand-in for the tensor-parallel pieces of ``transformer_engine.pytorch.distributed``: the
parameter attributes TE sets and the collectives of column / row parallel layers (with autograd),
in plain ``torch.distributed`` over the module's ``tp_group``."""

import torch
import torch.distributed as dist


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """The attributes TE (like Megatron) puts on its weights and column-parallel biases."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def get_distributed_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x.contiguous()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    assert x.shape[0] % size == 0, f"first dimension {x.shape[0]} does not split over {size} ranks"
    return _all_reduce(x, group).chunk(size, dim=0)[rank].contiguous()


def _identity(x: torch.Tensor, group) -> torch.Tensor:
    return x


class _Collective(torch.autograd.Function):
    """``forward_op(x, group)`` in forward, its adjoint ``backward_op(grad, group)`` in backward."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group), None, None, None


def column_parallel_input(x: torch.Tensor, group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """Under SP: all-gather along dim 0 (backward reduce-scatter); else identity (backward all-reduce)."""
    if tp_size == 1:
        return x
    if sequence_parallel:
        return _Collective.apply(x, group, _all_gather_first_dim, _reduce_scatter_first_dim)
    return _Collective.apply(x, group, _identity, _all_reduce)


def row_parallel_output(x: torch.Tensor, group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    """Under SP: reduce-scatter along dim 0 (backward all-gather); else all-reduce (backward identity)."""
    if tp_size == 1:
        return x
    if sequence_parallel:
        return _Collective.apply(x, group, _reduce_scatter_first_dim, _all_gather_first_dim)
    return _Collective.apply(x, group, _all_reduce, _identity)
