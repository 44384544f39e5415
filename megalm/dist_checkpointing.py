"""Layout-independent tensors in torch.distributed.checkpoint (DCP).

Every rank describes each tensor it holds as a block of a global tensor
(:class:`ShardedTensorSpec`: local data, global shape, global offsets).  DCP stores the
blocks with their offsets; on load each rank asks for the block it needs now, and DCP
reads the overlapping parts of whatever blocks were saved.  So a checkpoint saved under one
tensor/pipeline/data-parallel layout loads under any other.

Replicated copies (data-parallel replicas, or TP-replicated norms) describe the same block
and DCP's planner writes it once.  The two planners below only teach DCP that a plain local
tensor sits at a non-zero offset of its global tensor; all I/O and resharding is DCP's.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, LoadPlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


@dataclasses.dataclass
class ShardedTensorSpec:
    """``local`` is the block ``[offsets, offsets + local.shape)`` of a tensor of ``global_shape``."""

    local: torch.Tensor
    global_shape: Sequence[int]
    offsets: Sequence[int]

    def __post_init__(self):
        if len(self.global_shape) != self.local.dim() or len(self.offsets) != self.local.dim():
            raise ValueError(f"shard of shape {tuple(self.local.shape)} does not match global shape "
                             f"{tuple(self.global_shape)} / offsets {tuple(self.offsets)}")
        for size, off, full in zip(self.local.shape, self.offsets, self.global_shape):
            if off < 0 or off + size > full:
                raise ValueError(f"shard {tuple(self.local.shape)} at {tuple(self.offsets)} lies outside "
                                 f"{tuple(self.global_shape)}")

    @classmethod
    def replicated(cls, tensor: torch.Tensor) -> "ShardedTensorSpec":
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.local.shape))


ShardedStateDict = Dict[str, ShardedTensorSpec]


class _ShardSavePlanner(DefaultSavePlanner):
    def __init__(self, specs: ShardedStateDict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.specs = specs

    def create_local_plan(self) -> SavePlan:
        items: List[WriteItem] = []
        for fqn, spec in self.specs.items():
            if spec.local.numel() == 0:
                continue
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size(spec.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=spec.chunk(),
                                            properties=TensorProperties.create_from_tensor(spec.local),
                                            size=torch.Size(spec.global_shape))))
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self.specs[write_item.index.fqn].local.detach().contiguous()


class _ShardLoadPlanner(DefaultLoadPlanner):
    def __init__(self, specs: ShardedStateDict, strict: bool = True):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=not strict)
        self.specs = specs
        self.strict = strict

    def create_local_plan(self) -> LoadPlan:
        md = self.metadata.state_dict_metadata
        requests = []
        for fqn, spec in self.specs.items():
            if fqn not in md:
                if self.strict:
                    raise KeyError(f"checkpoint has no tensor named {fqn!r}")
                continue
            saved = md[fqn]
            if not hasattr(saved, "chunks"):
                raise ValueError(f"checkpoint entry {fqn!r} is not a tensor")
            if tuple(saved.size) != tuple(spec.global_shape):
                raise ValueError(f"checkpoint tensor {fqn!r} has shape {tuple(saved.size)}, "
                                 f"the model expects {tuple(spec.global_shape)}")
            if spec.local.numel():
                requests += create_read_items_for_chunk_list(fqn, saved, [spec.chunk()])
        self.plan = LoadPlan(requests)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.specs[index.fqn].local

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        # ``tensor`` is the narrowed view returned by resolve_tensor (already filled in place).
        pass

    def resolve_tensor(self, read_item):
        local = self.specs[read_item.dest_index.fqn].local
        view = local
        for dim, (off, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, off, length)
        return view


def save_sharded(specs: ShardedStateDict, path: str, process_group=None) -> None:
    """Collective: every rank of ``process_group`` (default world) calls this with its blocks."""
    dcp.save({k: v.local for k, v in specs.items()}, checkpoint_id=path, planner=_ShardSavePlanner(specs),
             process_group=process_group)


def load_sharded(specs: ShardedStateDict, path: str, strict: bool = True, process_group=None) -> None:
    """Collective: fill every ``spec.local`` in place from the checkpoint at ``path``."""
    for fqn, spec in specs.items():
        if not spec.local.is_contiguous():
            raise ValueError(f"load target {fqn!r} must be contiguous")
    dcp.load({k: v.local for k, v in specs.items()}, checkpoint_id=path,
             planner=_ShardLoadPlanner(specs, strict), process_group=process_group)


def saved_tensor_shapes(path: str) -> Dict[str, tuple]:
    """Names and global shapes of the tensors in a checkpoint, reading only its metadata."""
    reader = dcp.FileSystemReader(path)
    md = reader.read_metadata().state_dict_metadata
    return {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}


def saved_tensor_dtypes(path: str) -> Dict[str, torch.dtype]:
    reader = dcp.FileSystemReader(path)
    md = reader.read_metadata().state_dict_metadata
    return {k: v.properties.dtype for k, v in md.items() if hasattr(v, "properties")}
