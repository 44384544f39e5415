"""Where this rank's piece of a parameter sits in the full (global) tensor: checkpoint blocks.

The model's weights and the optimizers' state are checkpointed as blocks of the full tensors
(:class:`ShardedTensorSpec`: local data, global shape, global offsets), so any TP/PP/DP layout
can load them (:mod:`megalm.checkpoint.dcp_io` writes and reads them with DCP).  This module
defines those blocks and turns a parameter's layout record (:func:`megalm.tensor_parallel.param_info.param_info`:
``tensor_parallel``, ``partition_dim``, ``partition_stride``, ``vocab_unpadded``) and the size and rank of its
tensor-parallel group into such blocks: for a whole local tensor (:func:`param_spec`) or for a
flat range of it (:func:`param_range_specs`, the distributed optimizer's shards).  And a model's
parameters and persistent buffers under their global names (:func:`model_parameters`,
:func:`tied_embedding_copies`, :func:`model_buffers`: what a checkpoint saves, and what gradient
compression keys its layout-free state by).  No
communication; it imports neither the checkpointer nor the optimizers (both use it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.parameter_names import canonical_name
from megalm.tensor_parallel.param_info import ParamLayoutError, param_info


class BlockSource(Protocol):
    """Where the values of a block live when they are not in memory (the NVMe optimizer offload's swap files:
    :class:`megalm.optimizer.swap_blocks.SwapBlock`).  ``view`` is a meta-device view (any shape, strides and
    storage offset) of the meta tensor the source stands for."""

    def read(self, view: torch.Tensor) -> torch.Tensor:
        """A new host tensor holding the values of ``view``."""

    def write(self, view: torch.Tensor, values: torch.Tensor) -> None:
        """The values of ``view`` <- ``values`` (same shape)."""


@dataclasses.dataclass
class ShardedTensorSpec:
    """``local`` is the block ``[offsets, offsets + local.shape)`` of a tensor of ``global_shape``.

    With a ``source``, ``local`` is a meta-device view and the values live in the source (read on demand by
    :meth:`data`, written by :meth:`fill`): a checkpoint streams them one block at a time."""

    local: torch.Tensor
    global_shape: Sequence[int]
    offsets: Sequence[int]
    source: Optional[BlockSource] = None

    def data(self) -> torch.Tensor:
        """The block's values (read from the source, into new memory, when it has one)."""
        return self.local if self.source is None else self.source.read(self.local)

    def fill(self, view: torch.Tensor, values: torch.Tensor) -> None:
        """``view`` (of :attr:`local`, e.g. narrowed) <- ``values``, in memory or in the source."""
        if self.source is None:
            with torch.no_grad():
                view.copy_(values)
        else:
            self.source.write(view, values)

    def __post_init__(self):
        if len(self.global_shape) != self.local.dim() or len(self.offsets) != self.local.dim():
            raise ValueError(
                f"shard of shape {tuple(self.local.shape)} does not match global shape "
                f"{tuple(self.global_shape)} / offsets {tuple(self.offsets)}"
            )
        for size, off, full in zip(self.local.shape, self.offsets, self.global_shape):
            if off < 0 or off + size > full:
                raise ValueError(
                    f"shard {tuple(self.local.shape)} at {tuple(self.offsets)} lies outside {tuple(self.global_shape)}"
                )

    @classmethod
    def replicated(cls, tensor: torch.Tensor) -> "ShardedTensorSpec":
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.local.shape))


ShardedStateDict = Dict[str, Union[ShardedTensorSpec, List[ShardedTensorSpec]]]


def flat_range_blocks(shape: Sequence[int], start: int, end: int) -> List[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]:
    """Cut the flat (row-major) elements ``[start, end)`` of a tensor of ``shape`` into rectangular blocks.

    Returns ``(flat_start, offsets, sizes)`` per block, in flat order; each block is itself a
    contiguous flat range, so a 1-D slice ``data[flat_start - start:][:prod(sizes)]`` viewed as
    ``sizes`` is that block.  Per dimension: a partial first row, the full rows, a partial
    last row (recursively): at most ``2 (ndim - 1) + 1`` blocks.
    """
    shape = tuple(int(n) for n in shape)
    if start >= end:
        return []
    if start < 0 or end > math.prod(shape):
        raise ValueError(f"flat range [{start}, {end}) outside a tensor of shape {shape}")
    if len(shape) <= 1:
        return [(start, (start,) if shape else (), (end - start,) if shape else ())]
    inner = math.prod(shape[1:])

    def in_row(row: int, lo: int, hi: int):
        return [(row * inner + fs, (row,) + off, (1,) + size) for fs, off, size in flat_range_blocks(shape[1:], lo, hi)]

    first, last = start // inner, (end - 1) // inner
    if first == last:
        return in_row(first, start - first * inner, end - first * inner)
    blocks = []
    full_start, full_end = -(-start // inner), end // inner
    if start % inner:
        blocks += in_row(first, start % inner, inner)
    if full_end > full_start:
        blocks.append(
            (full_start * inner, (full_start,) + (0,) * (len(shape) - 1), (full_end - full_start,) + shape[1:])
        )
    if end % inner:
        blocks += in_row(full_end, 0, end % inner)
    return blocks


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
    :func:`flat_range_blocks`; each block is a view of ``data``.
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


def _is_tied_copy(name: str, p: torch.Tensor) -> bool:
    return param_info(p).copy_of is not None


def model_parameters(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, torch.nn.Parameter]:
    """Global parameter names -> parameters of this rank, skipping duplicate copies of tied weights.

    Names are canonical (:func:`megalm.parameter_names.canonical_name`): a Transformer Engine
    model's fused norm weights get the local names, so checkpoints are the same for both.
    """
    params: Dict[str, torch.nn.Parameter] = {}
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, p in module.named_parameters():
            if _is_tied_copy(name, p):
                continue  # the last stage's copy of a tied embedding: the first stage's is saved
            params[canonical_name(name)] = p
    return params


def tied_embedding_copies(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, tuple]:
    """``{copy name: (source name, parameter)}`` for the last pipeline stage's copies of a tied embedding.

    A copy is not saved (the first stage's embedding is) but is loaded from the source's tensors,
    weights and optimizer state alike: both copies receive the same summed gradient and the
    same update, so they are equal.  The source is the copy's ``param_info(p).copy_of`` (the word embedding).
    """
    out = {}
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, p in module.named_parameters():
            if _is_tied_copy(name, p):
                out[name] = (param_info(p).copy_of, p)
    return out


def model_buffers(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, torch.Tensor]:
    """Global names -> persistent buffers (training state that is not a parameter, e.g. a router's
    ``expert_bias``); each is replicated over TP and DP."""
    out = {}
    for chunk in model_chunks:
        for prefix, module in getattr(chunk, "module", chunk).named_modules():
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent_buffers_set:
                    out[canonical_name(f"{prefix}.{name}" if prefix else name)] = b
    return out
