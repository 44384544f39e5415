"""Reading a checkpoint's DCP ``.metadata`` without running code from it.

``torch.distributed.checkpoint`` (DCP) writes ``<iteration dir>/.metadata`` as a pickle, and its
:class:`~torch.distributed.checkpoint.FileSystemReader` reads it back with plain ``pickle.load``:
a crafted ``.metadata`` runs whatever it names.  Every megalm read of a checkpoint (training
``--load``, ``tools/checkpoint/*``, ``tools/generate.py``) goes through this module instead:

* :func:`load_metadata` unpickles ``.metadata`` with :class:`_MetadataUnpickler`, the pure-Python
  unpickler restricted three ways.  A global is looked up as an exact ``(module, qualified
  name)`` pair in :data:`_ALLOWED_GLOBALS` (objects resolved once, at import: no module is
  imported and no attribute is walked at load time, so ``os.system`` reached through a dotted
  name or through an allowed module is refused like any other name).  ``BUILD`` (setting an
  object's state) applies only to instances of DCP's metadata classes, never to a class or
  function.  Persistent ids and out-of-band buffers are refused.  The result must then have
  the shape megalm writes: a ``Metadata`` of tensor entries whose storage items name plain
  files of the checkpoint directory, with no storage transforms.  Only the Megatron-LM import
  (``load_metadata(..., allow_byte_entries=True)``) also accepts DCP's ``BytesStorageMetadata``
  entries (pickled objects such as Megatron's RNG state, which it lists but never reads; the
  ``common_state`` entry is read by :mod:`megalm.conversion.megatron_layouts` with
  ``torch.load(weights_only=True)``) and megatron-core's cached save plans (DCP's ``SavePlan`` /
  ``WriteItem`` dataclasses in ``Metadata.all_local_plans``, dropped once read).
* :class:`SafeFileSystemReader` is DCP's file reader with that metadata reader, without DCP's
  fall-back to per-rank ``__<rank>.metadata`` files (megalm never writes them), and refusing
  byte (non-tensor) items, which DCP's planners would ``torch.load(weights_only=False)``.
  Tensor data is read by DCP with ``torch.load(weights_only=True)``, one data file at a time: a file
  it cannot read (a refused pickle, a truncated file) raises :class:`CheckpointDataError` naming it.

Any refusal raises :class:`CheckpointSecurityError` naming the file and what was refused;
a missing or malformed file raises :class:`CheckpointMetadataError`.  No communication: each
rank that calls these reads the file itself.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
import types
from typing import Optional

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from megalm.checkpoint.errors import first_line
from megalm.errors import MegalmError

METADATA_FILENAME = ".metadata"


class CheckpointMetadataError(MegalmError, RuntimeError):
    """A checkpoint's ``.metadata`` is missing, unreadable or not DCP metadata."""


class CheckpointDataError(MegalmError, RuntimeError):
    """A checkpoint data file (``*.distcp``) cannot be read; the message names the file."""


class CheckpointSecurityError(CheckpointMetadataError):
    """A checkpoint's ``.metadata`` asks for something megalm never writes there (a global outside the
    allow-list, state on a class, a path outside the checkpoint...): refused before anything runs."""


def _dtype_globals() -> dict[tuple[str, str], torch.dtype]:
    """Every torch dtype under the name it pickles as (``torch.float32`` -> ``("torch", "float32")``)."""
    out = {}
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            out[("torch", value.__reduce__())] = value
    return out


# The only globals a megalm .metadata refers to (DCP 2.x, protocols 2-5), resolved now.
_ALLOWED_GLOBALS = types.MappingProxyType(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"): dcp_metadata.Metadata,
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"): dcp_metadata.TensorStorageMetadata,
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"): dcp_metadata.ChunkStorageMetadata,
        ("torch.distributed.checkpoint.metadata", "TensorProperties"): dcp_metadata.TensorProperties,
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"): dcp_metadata.MetadataIndex,
        ("torch.distributed.checkpoint.metadata", "StorageMeta"): dcp_metadata.StorageMeta,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): dcp_metadata._MEM_FORMAT_ENCODING,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # "torch.strided" -> torch.strided
        ("pathlib", "PosixPath"): pathlib.PosixPath,  # StorageMeta.checkpoint_id
        ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # the same, pickled by Python >= 3.13
        **_dtype_globals(),
    }
)

# Megatron-LM's torch_dist checkpoints list pickled objects (RNG state...) as byte entries, and
# megatron-core (0.15+) keeps its ranks' save plans in ``Metadata.all_local_plans`` (DCP's plain planner
# dataclasses, dropped after loading): accepted only by load_metadata(allow_byte_entries=True).
_MEGATRON_GLOBALS = types.MappingProxyType(
    {
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"): dcp_metadata.BytesStorageMetadata,
        ("torch.distributed.checkpoint.planner", "SavePlan"): dcp_planner.SavePlan,
        ("torch.distributed.checkpoint.planner", "WriteItem"): dcp_planner.WriteItem,
        ("torch.distributed.checkpoint.planner", "WriteItemType"): dcp_planner.WriteItemType,
        ("torch.distributed.checkpoint.planner", "TensorWriteData"): dcp_planner.TensorWriteData,
        ("torch.distributed.checkpoint.planner", "BytesIOWriteData"): dcp_planner.BytesIOWriteData,
    }
)
_MEGATRON_BUILDABLE = frozenset(
    {dcp_planner.SavePlan, dcp_planner.WriteItem, dcp_planner.TensorWriteData, dcp_planner.BytesIOWriteData}
)

# Instances whose state BUILD may set (TensorProperties through its own __setstate__).
_BUILDABLE = frozenset(
    {
        dcp_metadata.Metadata,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        _StorageInfo,
    }
)


class _MetadataUnpickler(pickle._Unpickler):
    """Python's unpickler with an exact global allow-list and ``BUILD`` limited to :data:`_BUILDABLE`."""

    def __init__(self, file, source: str, allow_byte_entries: bool = False):
        super().__init__(file)
        self.source = source
        self.allow_byte_entries = allow_byte_entries

    def refuse(self, what: str):
        raise CheckpointSecurityError(
            f"{self.source}: refusing to unpickle {what}: a checkpoint's .metadata may only hold "
            f"torch.distributed.checkpoint metadata (tensor entries, sizes, dtypes, file offsets); nothing from it "
            f"was run. The file was not written by megalm/DCP or was tampered with: do not load this checkpoint"
        )

    def find_class(self, module: str, name: str):
        obj = _ALLOWED_GLOBALS.get((module, name))
        if obj is None and self.allow_byte_entries:
            obj = _MEGATRON_GLOBALS.get((module, name))
        if obj is None:
            self.refuse(f"global {name!r} of module {module!r}")
        return obj

    def persistent_load(self, pid):
        self.refuse(f"persistent id {pid!r}")

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) not in _BUILDABLE and not (self.allow_byte_entries and type(inst) in _MEGATRON_BUILDABLE):
            self.refuse(f"object state for {type(inst).__qualname__} {inst!r:.80}")
        if "__setstate__" in vars(type(inst)):
            inst.__setstate__(state)
        elif type(state) is dict and all(type(k) is str for k in state):
            inst.__dict__.update(state)
        else:
            self.refuse(f"object state of type {type(state).__qualname__} for {type(inst).__qualname__}")

    dispatch = types.MappingProxyType({**pickle._Unpickler.dispatch, pickle.BUILD[0]: load_build})


def _check_shape(metadata, file: str, allow_byte_entries: bool = False) -> Metadata:
    """``metadata`` if it is what megalm writes: tensor entries stored in plain files of the directory
    (``allow_byte_entries``: also byte entries, listed by Megatron-LM's checkpoints, never read)."""
    if not isinstance(metadata, Metadata):
        raise CheckpointMetadataError(
            f"{file} does not hold torch.distributed.checkpoint metadata (found {type(metadata).__qualname__})"
        )
    entries, storage = vars(metadata).get("state_dict_metadata"), vars(metadata).get("storage_data")
    if type(entries) is not dict or type(storage) is not dict:
        raise CheckpointMetadataError(f"{file}: DCP metadata without its tensor entries or storage items")
    for key, entry in entries.items():
        if allow_byte_entries and type(entry) is dcp_metadata.BytesStorageMetadata:
            continue
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise CheckpointSecurityError(
                f"{file}: entry {key!r} is not a tensor (megalm checkpoints hold tensors only)"
            )
    for index, info in storage.items():
        if not isinstance(info, _StorageInfo):
            raise CheckpointSecurityError(f"{file}: storage item {index} is not a file range")
        path = info.relative_path
        if not isinstance(path, str) or path in ("", ".", "..") or os.path.basename(path) != path:
            raise CheckpointSecurityError(
                f"{file}: storage item {index} names {path!r}, not a file of the checkpoint directory"
            )
        if info.transform_descriptors:
            raise CheckpointSecurityError(
                f"{file}: storage item {index} asks for transforms "
                f"{list(info.transform_descriptors)} (megalm writes none)"
            )
    return metadata


def load_metadata(path: str, allow_byte_entries: bool = False) -> Metadata:
    """DCP metadata of the checkpoint directory ``path`` (or of a ``.metadata`` file), read safely;
    ``allow_byte_entries``: accept (not read) the pickled-object entries of Megatron-LM's checkpoints."""
    file = path if os.path.basename(path) == METADATA_FILENAME else os.path.join(path, METADATA_FILENAME)
    try:
        with open(file, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointMetadataError(f"cannot read {file}: {e}") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), file, allow_byte_entries).load()
    except CheckpointMetadataError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or malformed pickles raise many types
        raise CheckpointMetadataError(
            f"{file} is not a readable checkpoint metadata file: {type(e).__name__}: {e}"
        ) from None
    if allow_byte_entries and isinstance(metadata, Metadata) and "all_local_plans" in vars(metadata):
        metadata.all_local_plans = None  # megatron-core's cached save plans: not needed to read
    return _check_shape(metadata, file, allow_byte_entries)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader reading ``.metadata`` with :func:`load_metadata` (no per-rank fall-back)
    and refusing byte items; tensors are read by DCP with ``torch.load(weights_only=True)``."""

    def __init__(self, path, metadata: Optional[Metadata] = None):
        """``metadata``: this checkpoint's ``.metadata`` already read by :func:`load_metadata`
        (the loader reads it once for the saved shapes; DCP then does not read it again)."""
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:  # no ``rank`` keyword: DCP then never falls back to __<rank>.metadata
        metadata = self._metadata if self._metadata is not None else load_metadata(str(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        """DCP's read, one data file at a time, so that a file that cannot be read (a tensor record
        ``torch.load(weights_only=True)`` refuses, a truncated file) is named: :class:`CheckpointDataError`."""
        per_file = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointSecurityError(
                    f"{self.path}: refusing to read {item.storage_index.fqn!r} as "
                    f"pickled bytes (megalm checkpoints hold tensors only)"
                )
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner)
            except Exception as e:  # noqa: BLE001 - UnpicklingError, OSError, RuntimeError from torch.load
                file = os.path.join(str(self.path), relative_path)
                raise CheckpointDataError(f"cannot read {file}: {type(e).__name__}: {first_line(e)}") from None
        fut = Future()
        fut.set_result(None)
        return fut
