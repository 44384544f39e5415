"""Tensor-parallel linear layers and the vocabulary-parallel embedding.

Weights are ``[out, in]`` as in ``torch.nn.Linear``.  Every parameter gets the attribute
contract of :mod:`megalm.tensor_parallel.utils` and an init rule
(:func:`megalm.tensor_parallel.initialization.mark_init`); values are filled later by
``initialize_weights``.  Activations are ``[s, b, h]``; under sequence parallelism the
replicated side of a layer is ``[s/tp, b, h]``.

Every layer communicates over the ``tp_group`` it is built with, a required argument (``None``:
this rank alone, no communication; models pass their ``process_groups.tp``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalm.device import get_device
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.mappings import (
    all_gather_first_dim,
    all_reduce,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_first_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalm.tensor_parallel.param_info import set_param_info
from megalm.tensor_parallel.utils import divide, set_tensor_model_parallel_attributes


class _ColumnParallelLinearFunction(torch.autograd.Function):
    """``total_input @ W^T + b`` where ``total_input`` is the input gathered along the sequence
    under sequence parallelism.

    Forward: all-gather of the ``[s/tp, b, h]`` input along dim 0 under SP (only the local
    shard is saved; it is gathered again in backward), nothing otherwise.
    Backward: input gradient reduce-scattered along dim 0 under SP, or all-reduced over TP
    otherwise; both are launched asynchronously and overlap the weight-gradient matmul.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, sequence_parallel: bool, group):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.sequence_parallel, ctx.group = sequence_parallel, group
        total = all_gather_first_dim(x, group)[0] if sequence_parallel else x
        out = torch.matmul(total, weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        # Under autocast the forward ran in a lower precision than the saved tensors: match it.
        x, weight = x.to(grad_out.dtype), weight.to(grad_out.dtype)
        gather = None
        total = x
        if ctx.sequence_parallel and ctx.needs_input_grad[1]:
            total, gather = all_gather_first_dim(x, ctx.group, async_op=True)
        grad_input, reduce = None, None
        if ctx.needs_input_grad[0]:
            grad_input = grad_out.matmul(weight)
            if ctx.sequence_parallel:
                grad_input, reduce = reduce_scatter_first_dim(grad_input, ctx.group, async_op=True)
            else:  # in place: grad_input is this function's own matmul output
                grad_input, reduce = all_reduce(grad_input, ctx.group, async_op=True)
        if gather is not None:
            gather.wait()
        grad_out_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_out_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_bias = grad_out_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if reduce is not None:
            reduce.wait()
        return grad_input, grad_weight, grad_bias, None, None


def _new_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=get_device()))


class ColumnParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W`` split along its output dimension: rank ``r`` computes
    columns ``[r out/tp, (r+1) out/tp)`` of ``Y``.

    Forward: input replicated -> nothing sent (all-gather along the sequence under SP);
    the output stays split along its last dimension unless ``gather_output`` (all-gather).
    Backward: the input gradient is all-reduced over TP (reduce-scattered along the
    sequence under SP); with ``gather_output`` the output gradient is split locally.

    ``stride=2`` marks a fused ``[gate; up]`` weight whose rank-``r`` shard is
    ``[gate_r; up_r]``.  With ``skip_weight_param_allocation`` the weight is passed to
    :meth:`forward` (tied output layer).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_std: float = 0.02,
        stride: int = 1,
        sequence_parallel: bool = False,
        skip_weight_param_allocation: bool = False,
        vocab_unpadded: Optional[int] = None,
        skip_bias_add: bool = False,
        dtype: torch.dtype = torch.float32,
        tp_group,
    ):
        super().__init__()
        if skip_bias_add and gather_output:
            raise ValueError(
                "ColumnParallelLinear: skip_bias_add returns this rank's bias slice; it cannot be "
                "combined with gather_output"
            )
        self.tp_group = tp_group
        self.tp_size = group_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        if skip_weight_param_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = _new_parameter(self.output_size_per_partition, input_size, dtype=dtype)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
            mark_init(self.weight, "normal", init_std)
            if vocab_unpadded is not None:
                set_param_info(self.weight, vocab_unpadded=vocab_unpadded)
        if bias:
            self.bias = _new_parameter(self.output_size_per_partition, dtype=dtype)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            mark_init(self.bias, "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None):
        """The output, or ``(output without bias, bias)`` with ``skip_bias_add`` (for a fused bias op)."""
        weight = self.weight if weight is None else weight
        if weight is None:
            raise RuntimeError("ColumnParallelLinear built with skip_weight_param_allocation needs forward(x, weight)")
        bias = None if self.skip_bias_add else self.bias
        if self.tp_size == 1:
            out = F.linear(x, weight, bias)
        else:
            out = _ColumnParallelLinearFunction.apply(x, weight, bias, self.sequence_parallel, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return gather_from_tensor_model_parallel_region(out, self.tp_group) if self.gather_output else out

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, out_per_rank={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W`` split along its input dimension: rank ``r`` multiplies
    input features ``[r in/tp, (r+1) in/tp)`` and the partial products are summed.

    Forward: input already split along its last dimension (``input_is_parallel``; else a
    local split), local matmul, then all-reduce over TP (reduce-scatter along the sequence
    under SP, giving ``[s/tp, b, h]``); the bias is added after the reduction.
    Backward: the output gradient is used as is (all-gathered along the sequence under SP).
    Under SP the bias gradient is partial per rank: the bias carries ``sequence_parallel``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_std: float = 0.02,
        sequence_parallel: bool = False,
        skip_bias_add: bool = False,
        dtype: torch.dtype = torch.float32,
        tp_group,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(self.tp_group)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.skip_bias_add = skip_bias_add
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")
        self.weight = _new_parameter(output_size, self.input_size_per_partition, dtype=dtype)
        set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
        mark_init(self.weight, "normal", init_std)
        if bias:
            self.bias = _new_parameter(output_size, dtype=dtype)
            set_tensor_model_parallel_attributes(self.bias, False, -1)
            mark_init(self.bias, "zeros")
            set_param_info(self.bias, sequence_parallel=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        """The output, or ``(output without bias, bias)`` with ``skip_bias_add`` (for a fused bias op)."""
        if self.tp_size == 1:
            out = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        else:
            if not self.input_is_parallel:
                x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
            partial = torch.matmul(x, self.weight.t())
            if self.sequence_parallel:
                out = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
            else:  # in place: the matmul output is a temporary that autograd did not save
                out = reduce_from_tensor_model_parallel_region(partial, self.tp_group, in_place=True)
            if self.bias is not None and not self.skip_bias_add:
                out = out + self.bias
        return (out, self.bias) if self.skip_bias_add else out

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, in_per_rank={self.input_size_per_partition}, out={self.output_size}, "
            f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Word embedding with the (padded) vocabulary split over TP ranks along dim 0.

    Rank ``r`` owns rows ``[r V/tp, (r+1) V/tp)``; tokens outside its range look up row 0
    and are zeroed, so the sum over ranks is the full lookup.
    Forward: all-reduce of ``[b, s, h]`` over TP; with ``reduce_scatter_to_sequence`` the
    output is transposed to ``[s, b, h]`` and reduce-scattered along the sequence instead
    (``[s/tp, b, h]``).  Backward: nothing for all-reduce (the gradient is replicated);
    all-gather along the sequence for the reduce-scatter form.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_std: float = 0.02,
        vocab_unpadded: Optional[int] = None,
        reduce_scatter_to_sequence: bool = False,
        dtype: torch.dtype = torch.float32,
        tp_group,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(self.tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_partition = divide(num_embeddings, self.tp_size)
        self.vocab_start = group_rank(self.tp_group) * self.per_partition
        self.vocab_end = self.vocab_start + self.per_partition
        self.reduce_scatter_to_sequence = reduce_scatter_to_sequence and self.tp_size > 1
        self.weight = _new_parameter(self.per_partition, embedding_dim, dtype=dtype)
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        mark_init(self.weight, "normal", init_std)
        set_param_info(self.weight, vocab_unpadded=num_embeddings if vocab_unpadded is None else vocab_unpadded)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        outside = (token_ids < self.vocab_start) | (token_ids >= self.vocab_end)
        local_ids = (token_ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_to_sequence:
            return reduce_scatter_to_sequence_parallel_region(partial.transpose(0, 1).contiguous(), self.tp_group)
        # in place: the masked lookup is a temporary (masked_fill saves only its mask)
        return reduce_from_tensor_model_parallel_region(partial, self.tp_group, in_place=True)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, per_rank={self.per_partition}, dim={self.embedding_dim}"
