"""Where this rank's piece of a parameter sits in the full (global) tensor: checkpoint blocks.

The model's weights and the optimizers' state are checkpointed as blocks of the full tensors
(:class:`megalm.dist_checkpointing.ShardedTensorSpec`), so any TP/PP/DP layout can load them.
This module turns a parameter's layout record (:func:`megalm.tensor_parallel.param_info.param_info`:
``tensor_parallel``, ``partition_dim``, ``partition_stride``, ``vocab_unpadded``) and the size and rank of its
tensor-parallel group into such blocks: for a whole local tensor (:func:`param_spec`) or for a
flat range of it (:func:`param_range_specs`, the distributed optimizer's shards).  No
communication; it imports neither the checkpointer nor the optimizers (both use it).
"""

from __future__ import annotations

import math
from typing import List, Optional, Union

import torch

from megalm.dist_checkpointing import ShardedTensorSpec, flat_range_blocks
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.tensor_parallel.param_info import ParamLayoutError, param_info


def param_spec(
    param: torch.Tensor, data: Optional[torch.Tensor] = None, *, groups: ProcessGroups
) -> Union[ShardedTensorSpec, List[ShardedTensorSpec]]:
    """Where this rank's piece of ``param`` sits in the full tensor (from its TP attributes).

    ``data`` (default ``param`` itself) is any tensor laid out like the parameter, e.g. an
    Adam moment or an fp32 main copy.  ``groups`` (this rank's process groups, required): its
    ``tp`` gives the TP size and rank, its
    ``etp`` those of a split expert parameter (``--expert-tensor-parallel-size``).

    A fused ``[gate; up]`` weight is checkpointed in its ``(2, n)`` view along the split dim, except an
    expert's, which is stored as the whole ``[2n, ...]`` tensor whatever the ETP (as when experts are
    whole): its ETP shard ``[gate_r; up_r]`` is then a list of two blocks.
    """
    spec = _view_spec(param, data, groups)
    info = param_info(param)
    if info.expert and info.tensor_parallel and info.partition_stride > 1:
        return _merge_stride_axis(spec, info.partition_dim % param.dim())
    return spec


def _merge_stride_axis(spec: ShardedTensorSpec, dim: int) -> List[ShardedTensorSpec]:
    """Blocks of the fused tensor (``stride * m`` along ``dim``) from a block of its ``(stride, m)`` view
    (dims ``dim`` and ``dim + 1``): one block per stride index the block covers."""
    g = list(spec.global_shape)
    width = g[dim + 1]
    global_shape = g[:dim] + [g[dim] * width] + g[dim + 2 :]
    blocks = []
    for i in range(spec.local.shape[dim]):
        row = (spec.offsets[dim] + i) * width + spec.offsets[dim + 1]
        offsets = list(spec.offsets[:dim]) + [row] + list(spec.offsets[dim + 2 :])
        blocks.append(ShardedTensorSpec(spec.local.select(dim, i), global_shape, offsets))
    return blocks


def _view_spec(param: torch.Tensor, data: Optional[torch.Tensor], groups: ProcessGroups) -> ShardedTensorSpec:
    """:func:`param_spec` with fused weights always in their ``(stride, n)`` view."""
    data = param.detach() if data is None else data
    info = param_info(param)
    if info.replicated:
        return ShardedTensorSpec.replicated(data)
    split_group = groups.etp if info.expert else groups.tp
    tp, rank = group_size(split_group), group_rank(split_group)
    dim = info.partition_dim % data.dim()
    stride = info.partition_stride
    local = list(data.shape)
    if stride > 1:
        # A fused [a; b] weight split as [a_r; b_r]: view as (stride, n/stride) along ``dim``.
        view = data.reshape(local[:dim] + [stride, local[dim] // stride] + local[dim + 1 :])
        global_shape = local[:dim] + [stride, local[dim] // stride * tp] + local[dim + 1 :]
        offsets = [0] * view.dim()
        offsets[dim + 1] = rank * (local[dim] // stride)
        return ShardedTensorSpec(view, global_shape, offsets)
    offsets = [0] * data.dim()
    offsets[dim] = rank * local[dim]
    global_shape = list(local)
    global_shape[dim] = local[dim] * tp
    vocab = info.vocab_unpadded
    if vocab is not None and dim == 0:
        # Padded vocabulary rows are not saved: the padding depends on the TP size.
        keep = max(0, min(local[0], vocab - offsets[0]))
        data = data.narrow(0, 0, keep)
        global_shape[0] = vocab
        offsets[0] = min(offsets[0], vocab)
    return ShardedTensorSpec(data, global_shape, offsets)


def param_range_specs(
    param: torch.Tensor, data: torch.Tensor, start: int, end: int, *, groups: ProcessGroups
) -> List[ShardedTensorSpec]:
    """Blocks of the full tensor covered by the flat range ``[start, end)`` of this rank's ``param``.

    ``data`` is 1-D with ``end - start`` elements (e.g. the distributed optimizer's moments for
    that range).  The range is cut into rectangles of the parameter's checkpoint view (see
    :func:`param_spec`: TP offset, fused-stride view, unpadded vocabulary) by
    :func:`megalm.dist_checkpointing.flat_range_blocks`; each block is a view of ``data``.
    """
    if data.dim() != 1 or data.numel() != end - start:
        raise ParamLayoutError(f"range data must be 1-D with {end - start} elements, got {tuple(data.shape)}")
    where = _view_spec(param, torch.empty(param.shape, device="meta"), groups)
    view_shape = tuple(where.local.shape)  # the flat order of the local tensor, possibly cut to fewer rows
    end_kept = min(end, math.prod(view_shape))
    info = param_info(param)
    merge = info.expert and info.tensor_parallel and info.partition_stride > 1  # see param_spec
    specs = []
    for flat, offsets, sizes in flat_range_blocks(view_shape, start, end_kept) if start < end_kept else []:
        block = data[flat - start : flat - start + math.prod(sizes)].view(sizes)
        spec = ShardedTensorSpec(block, tuple(where.global_shape), tuple(o + w for o, w in zip(offsets, where.offsets)))
        specs += _merge_stride_axis(spec, info.partition_dim % param.dim()) if merge else [spec]
    return specs
