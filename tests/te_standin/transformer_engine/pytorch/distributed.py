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


class _CopyToRegion(torch.autograd.Function):
    """Column parallel input without SP: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """Column parallel input under SP: forward all-gather along dim 0, backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first_dim(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """Row parallel output without SP: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterSequence(torch.autograd.Function):
    """Row parallel output under SP: forward reduce-scatter along dim 0, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_first_dim(grad, ctx.group), None


def column_parallel_input(x: torch.Tensor, group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    if tp_size == 1:
        return x
    return _GatherSequence.apply(x, group) if sequence_parallel else _CopyToRegion.apply(x, group)


def row_parallel_output(x: torch.Tensor, group, tp_size: int, sequence_parallel: bool) -> torch.Tensor:
    if tp_size == 1:
        return x
    return _ReduceScatterSequence.apply(x, group) if sequence_parallel else _ReduceFromRegion.apply(x, group)
