"""Shapes and shard arithmetic of tensor parallelism.

A parameter's split (``tensor_parallel``, ``partition_dim``, ``partition_stride``) is part of
its :class:`~megalm.tensor_parallel.param_info.ParamInfo` record, read with
:func:`~megalm.tensor_parallel.param_info.param_info`.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

from megalm.parallel_state import group_size
from megalm.tensor_parallel.param_info import ParamInfo, param_info, set_param_info

# torch >= 2.13 renamed the flat collectives; keep the old names for older releases.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; raises with both numbers when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Mark ``param`` as split along ``dim`` (or replicated when ``is_parallel`` is False) in its record."""
    set_param_info(
        param,
        tensor_parallel=bool(is_parallel),
        partition_dim=int(dim) if is_parallel else -1,
        partition_stride=int(stride) if is_parallel else 1,
    )


def full_shape(param: torch.Tensor, tp_size: int) -> List[int]:
    """Shape of the gathered (unsplit) tensor of which ``param`` is this rank's shard."""
    shape, info = list(param.shape), param_info(param)
    if info.tensor_parallel and tp_size > 1:
        shape[info.partition_dim] *= tp_size
    return shape


def shard_of_full(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """The shard of ``full`` that TP rank ``rank`` of ``size`` holds (a view; chunks cat'ed for stride > 1)."""
    if size == 1:
        return full
    chunks = torch.chunk(full, stride * size, dim=dim)
    if len(chunks) != stride * size or full.shape[dim] % (stride * size) != 0:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into {stride} x {size} chunks")
    mine = chunks[rank::size]
    return mine[0] if stride == 1 else torch.cat(mine, dim=dim)


def assemble_full(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_of_full`: the full tensor from every rank's shard (in rank order)."""
    size = len(shards)
    if size == 1:
        return shards[0]
    pieces = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([pieces[r][k] for k in range(stride) for r in range(size)], dim=dim)


def gather_tensor_parallel_param(param: torch.Tensor, group) -> torch.Tensor:
    """Full tensor of a TP-split parameter (or its grad), all-gathered over ``group`` (default:
    this rank's TP group).

    Sends this rank's shard to every TP rank (one all-gather); returns a new tensor.  A
    replicated tensor is returned as a copy.  Meant for tests, export and checkpoint tools.
    """
    return _gather_shards(param.detach(), param_info(param), group)


def gather_shards(source: torch.Tensor, info: ParamInfo, group) -> torch.Tensor:
    """Full tensor of which ``source`` is this rank's piece, laid out as a parameter with record
    ``info`` (any tensor shaped like it: a gradient, an optimizer state); one all-gather over ``group``."""
    return _gather_shards(source, info, group)


def _gather_shards(source: torch.Tensor, info: ParamInfo, group) -> torch.Tensor:
    size = group_size(group)
    if info.replicated or size == 1:
        return source.clone()
    dim, stride = info.partition_dim, info.partition_stride
    moved = source.movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0],) + tuple(moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    all_gather_flat(out, moved, group=group)
    shards = [s.movedim(0, dim) for s in torch.chunk(out, size, dim=0)]
    return assemble_full(shards, dim, stride)


def gather_tensor_parallel_grad(param: torch.Tensor, group) -> torch.Tensor:
    """Full gradient of a parameter (``main_grad`` when present, else ``grad``), gathered over TP."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        raise ValueError("parameter has no gradient")
    return _gather_shards(grad.detach(), param_info(param), group)


def sequence_parallel_enabled(parallel_cfg, tp_size: int) -> bool:
    """Sequence parallelism is on only with the flag and a tensor-parallel size above one."""
    return bool(parallel_cfg.sequence_parallel) and tp_size > 1
