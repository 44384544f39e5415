"""Shapes, shard arithmetic and the parameter attribute contract of tensor parallelism.

Attribute contract (every parameter of a megalm model carries it; checkpointing, DDP and
the optimizer read it):

* ``tensor_model_parallel`` (bool): the parameter is split over tensor-parallel ranks.
* ``partition_dim`` (int): the split dimension, ``-1`` when not split.
* ``partition_stride`` (int): 1, or 2 for a fused ``[gate; up]`` SwiGLU weight whose TP
  rank ``r`` holds ``[gate_r; up_r]``.  In general the full tensor is cut into
  ``stride * tp`` equal chunks along ``partition_dim`` and rank ``r`` holds chunks
  ``r, r + tp, r + 2 tp, ...`` concatenated (Megatron's convention).

Optional attributes: ``sequence_parallel`` (grads must be all-reduced over TP, see
:mod:`megalm.tensor_parallel.grads`), ``vocab_unpadded`` (true vocabulary size of a padded
embedding / output weight), ``shared_embedding`` (tied word embedding / output weight
whose grads are summed over the embedding group when the two live on different stages).
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

from megalm import parallel_state

# torch >= 2.13 renamed the flat collectives; keep the old names for older releases.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def divide(numerator: int, denominator: int) -> int:
    """Exact integer division; raises with both numbers when it does not divide."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Mark ``param`` as split along ``dim`` (or replicated when ``is_parallel`` is False)."""
    param.tensor_model_parallel = bool(is_parallel)
    param.partition_dim = int(dim) if is_parallel else -1
    param.partition_stride = int(stride) if is_parallel else 1


def set_defaults_if_not_set_tensor_model_parallel_attributes(param: torch.Tensor) -> None:
    """Give a replicated parameter the default attributes (idempotent)."""
    for name, value in _DEFAULTS.items():
        if not hasattr(param, name):
            setattr(param, name, value)


def copy_tensor_model_parallel_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    for name in _DEFAULTS:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for a replicated parameter on TP rank > 0 (counted once in norms and sizes)."""
    return not getattr(param, "tensor_model_parallel", False) and parallel_state.get_tensor_model_parallel_rank() > 0


def full_shape(param: torch.Tensor, tp_size: int) -> List[int]:
    """Shape of the gathered (unsplit) tensor of which ``param`` is this rank's shard."""
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
        shape[param.partition_dim] *= tp_size
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


def split_tensor_along_dim(tensor: torch.Tensor, dim: int, num_partitions: int) -> List[torch.Tensor]:
    """Equal views along ``dim`` (raises when it does not divide)."""
    divide(tensor.shape[dim], num_partitions)
    return list(torch.chunk(tensor, num_partitions, dim=dim))


def gather_tensor_parallel_param(param: torch.Tensor, group=None) -> torch.Tensor:
    """Full tensor of a TP-split parameter (or its grad), all-gathered over the TP group.

    Sends this rank's shard to every TP rank (one all-gather); returns a new tensor.  A
    replicated tensor is returned as a copy.  Meant for tests, export and checkpoint tools.
    """
    size = parallel_state.get_tensor_model_parallel_world_size()
    source = param.detach()
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return source.clone()
    group = group or parallel_state.get_tensor_model_parallel_group()
    dim, stride = param.partition_dim, param.partition_stride
    moved = source.movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0],) + tuple(moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    all_gather_flat(out, moved, group=group)
    shards = [s.movedim(0, dim) for s in torch.chunk(out, size, dim=0)]
    return assemble_full(shards, dim, stride)


def gather_tensor_parallel_grad(param: torch.Tensor, group=None) -> torch.Tensor:
    """Full gradient of a parameter (``main_grad`` when present, else ``grad``), gathered over TP."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
    if grad is None:
        raise ValueError("parameter has no gradient")
    holder = grad.detach()
    for name in _DEFAULTS:
        setattr(holder, name, getattr(param, name, _DEFAULTS[name]))
    return gather_tensor_parallel_param(holder, group)


def sequence_parallel_enabled(parallel_cfg, tp_size: int) -> bool:
    """Sequence parallelism is on only with the flag and a tensor-parallel size above one."""
    return bool(parallel_cfg.sequence_parallel) and tp_size > 1
