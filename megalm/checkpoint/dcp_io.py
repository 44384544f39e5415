"""Layout-independent tensors in torch.distributed.checkpoint (DCP).

Every rank describes each tensor it holds as a block of a global tensor
(:class:`megalm.param_layout.ShardedTensorSpec`: local data, global shape, global offsets).  DCP stores the
blocks with their offsets; on load each rank asks for the block it needs now, and DCP
reads the overlapping parts of whatever blocks were saved.  So a checkpoint saved under one
tensor/pipeline/data-parallel layout loads under any other.

Replicated copies (data-parallel replicas, or TP-replicated norms) describe the same block
and DCP's planner writes it once.  The two planners below only teach DCP that a plain local
tensor sits at a non-zero offset of its global tensor; all I/O and resharding is DCP's.

A key may also map to a *list* of specs: several disjoint blocks of one global tensor held by
one rank (the distributed optimizer's shard of a flattened bucket covers, for each parameter,
a contiguous range of its flattened tensor, which :func:`megalm.param_layout.flat_range_blocks` cuts into at most
``2 (ndim - 1) + 1`` rectangular blocks).  Each block is its own DCP chunk (write item) on save
and its own destination chunk on load.

Loading never uses DCP's plain-pickle metadata reader: ``.metadata`` is read by
:mod:`megalm.checkpoint.safe_metadata` (an exact allow-list of DCP's metadata classes), tensors by DCP
with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
from typing import Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.safe_metadata import SafeFileSystemReader, load_metadata
from megalm.param_layout import ShardedStateDict, ShardedTensorSpec


class CheckpointTensorError(CheckpointError, ValueError):
    """The checkpoint lacks a tensor the model needs, or holds it with another shape or kind."""


def _as_list(value) -> List[ShardedTensorSpec]:
    return value if isinstance(value, list) else [value]


def _local(spec: ShardedTensorSpec) -> torch.Tensor:
    # The planners below read the specs, never this dict; a block with a source (meta) is an empty stand-in
    # here, so that DCP's set-up does not allocate it (it gives meta tensors real memory).
    return spec.local if spec.source is None else torch.empty(0, dtype=spec.local.dtype)


def _locals(specs: ShardedStateDict) -> dict:
    return {k: [_local(s) for s in v] if isinstance(v, list) else _local(v) for k, v in specs.items()}


class _ShardSavePlanner(DefaultSavePlanner):
    def __init__(self, specs: ShardedStateDict, objects: Optional[Dict[str, bytes]] = None, streaming: bool = False):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.specs = specs
        self.objects = objects or {}
        self.streaming = streaming  # see resolve_data (with DCP's serial loader only: save_sharded)
        self._previous = None
        self._by_offsets = {(fqn, tuple(s.offsets)): s for fqn, v in specs.items() for s in _as_list(v)}

    def create_local_plan(self) -> SavePlan:
        items: List[WriteItem] = []
        for fqn, value in self.specs.items():
            for spec in _as_list(value):
                if spec.local.numel() == 0:
                    continue
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(spec.offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=spec.chunk(),
                            properties=TensorProperties.create_from_tensor(spec.local),
                            size=torch.Size(spec.global_shape),
                        ),
                    )
                )
        for fqn in self.objects:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.objects[write_item.index.fqn])
        spec = self._by_offsets[(write_item.index.fqn, tuple(write_item.index.offset))]
        if not self.streaming:
            return spec.local.detach().contiguous()
        # DCP's serial loader resolves an item only once the one before was written, but its writer keeps
        # every written tensor referenced until the file is complete: the copy made for the previous item
        # is freed here (its storage emptied), so one block is in memory at a time.
        if self._previous is not None:
            self._previous.untyped_storage().resize_(0)
            self._previous = None
        data = spec.data().detach()
        if spec.source is None and data.is_cpu and data.untyped_storage().nbytes() == data.nbytes:
            return data.contiguous() if data.is_contiguous() else self._keep(data.contiguous())
        return self._keep(data.to("cpu", copy=spec.source is None).contiguous())

    def _keep(self, copy: torch.Tensor) -> torch.Tensor:
        self._previous = copy
        return copy


class _ShardLoadPlanner(DefaultLoadPlanner):
    def __init__(self, specs: ShardedStateDict, strict: bool = True):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=not strict)
        # Empty blocks read nothing; the read items' dest_index.index is the position in this list.
        self.specs = {k: [s for s in _as_list(v) if s.local.numel()] for k, v in specs.items()}
        self._shapes = {k: [tuple(s.global_shape) for s in _as_list(v)] for k, v in specs.items()}
        self.strict = strict

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        requests = []
        for fqn, specs in self.specs.items():
            if fqn not in md:
                if self.strict:
                    raise CheckpointTensorError(f"checkpoint has no tensor named {fqn!r}")
                continue
            saved = md[fqn]
            if not hasattr(saved, "chunks"):
                raise CheckpointTensorError(f"checkpoint entry {fqn!r} is not a tensor")
            for shape in self._shapes[fqn]:
                if tuple(saved.size) != shape:
                    raise CheckpointTensorError(
                        f"checkpoint tensor {fqn!r} has shape {tuple(saved.size)}, the model expects {shape}"
                    )
            if specs:
                requests += create_read_items_for_chunk_list(fqn, saved, [s.chunk() for s in specs])
        self.plan = LoadPlan(requests)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.specs[index.fqn][index.index or 0].local

    def _target(self, read_item):
        spec = self.specs[read_item.dest_index.fqn][read_item.dest_index.index or 0]
        view = spec.local
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, off, length)
        return spec, view

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        # ``tensor`` is resolve_tensor's: the narrowed view (already filled in place), or for a block with a
        # source a new tensor that goes to the source now (one read item's block in memory at a time).
        spec, view = self._target(read_item)
        if spec.source is not None:
            spec.fill(view, tensor)

    def resolve_tensor(self, read_item):
        spec, view = self._target(read_item)
        return view if spec.source is None else torch.empty(view.shape, dtype=view.dtype)


def save_sharded(
    specs: ShardedStateDict, path: str, process_group=None, objects: Optional[Dict[str, bytes]] = None
) -> None:
    """Collective: every rank of ``process_group`` (default world) calls this with its blocks.  ``objects``:
    byte entries (already serialized) to write beside the tensors (one rank gives them).

    The save streams when a block has a source (the NVMe offload's swapped optimizer state) or every block is
    in host memory: DCP's serial loader (no copy-ahead, which would read many blocks before writing one) and
    one copy of a block in memory at a time (:meth:`_ShardSavePlanner.resolve_data`; without it DCP's writer
    keeps every copy it makes, e.g. of each view into a DDP buffer, until the file is written).  The files hold
    the same items either way (on CUDA the copy-ahead loader writes them smallest first, the serial one largest
    first: the offsets in ``.metadata`` differ, not the data)."""
    blocks = [s for v in specs.values() for s in _as_list(v)]
    streaming = any(s.source is not None for s in blocks) or all(s.local.device.type in ("cpu", "meta") for s in blocks)
    state = {**_locals(specs), **{k: io.BytesIO(v) for k, v in (objects or {}).items()}}
    dcp.save(
        state,
        checkpoint_id=path,
        storage_writer=FileSystemWriter(path, per_thread_copy_ahead=0) if streaming else None,
        planner=_ShardSavePlanner(specs, objects, streaming),
        process_group=process_group,
    )


def load_sharded(specs: ShardedStateDict, path: str, strict: bool = True, process_group=None, metadata=None) -> None:
    """Collective: fill every ``spec.local`` in place from the checkpoint at ``path`` (``metadata``:
    its ``.metadata`` if the caller already read it with :func:`megalm.checkpoint.safe_metadata.load_metadata`)."""
    for fqn, value in specs.items():
        for spec in _as_list(value):
            if not spec.local.is_contiguous():
                raise ValueError(f"load target {fqn!r} must be contiguous")  # internal: the model's own tensors
    dcp.load(
        _locals(specs),
        storage_reader=SafeFileSystemReader(path, metadata),
        planner=_ShardLoadPlanner(specs, strict),
        process_group=process_group,
    )


def saved_tensor_shapes(path: str) -> Dict[str, tuple]:
    """Names and global shapes of the tensors in a checkpoint, reading only its metadata (safely)."""
    return tensor_shapes(load_metadata(path))


def tensor_shapes(metadata) -> Dict[str, tuple]:
    """Names and global shapes of the tensors a checkpoint's ``.metadata`` describes (byte entries left out)."""
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}


def saved_tensor_dtypes(path: str) -> Dict[str, torch.dtype]:
    md = load_metadata(path).state_dict_metadata
    return {k: v.properties.dtype for k, v in md.items()}
