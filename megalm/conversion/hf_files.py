"""Hugging Face model directories: ``config.json`` and safetensors weights, nothing pickled.

Reading: ``model.safetensors`` or ``model.safetensors.index.json`` + its shards; tensors are
opened lazily (:class:`HFWeights`).  A directory holding only ``pytorch_model.bin`` (a
pickle) is refused with a message.

Writing (:class:`SafetensorsWriter`): tensors are added one by one and written in shards of
at most ``max_shard_bytes``; one shard is named ``model.safetensors``, several
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` (``metadata.total_size``
and ``weight_map``), as ``save_pretrained`` does.  Only one shard is held in memory.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

import torch

from megalm.conversion.errors import ConversionError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.bin", "consolidated.00.pth")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{directory} has no config.json: not a Hugging Face model directory")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


class HFWeights:
    """The tensors of a Hugging Face directory's safetensors files, opened lazily."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        self.directory = directory
        index = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, SINGLE_FILE)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map: Dict[str, str] = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = [SINGLE_FILE]
            weight_map = None
        else:
            pickled = [n for n in PICKLE_FILES if os.path.exists(os.path.join(directory, n))]
            if pickled:
                raise ConversionError(
                    f"{directory} holds {pickled[0]}, a pickle: megalm never unpickles checkpoints. Convert it to "
                    f"safetensors first (e.g. in a trusted environment: transformers' "
                    f"model.save_pretrained(dir, safe_serialization=True))"
                )
            raise ConversionError(f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}")
        self._handles = {name: safe_open(os.path.join(directory, name), framework="pt") for name in files}
        if weight_map is None:
            weight_map = {key: SINGLE_FILE for key in self._handles[SINGLE_FILE].keys()}
        self.weight_map = weight_map

    def keys(self) -> List[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        if name not in self.weight_map:
            raise ConversionError(f"{self.directory}: no tensor {name!r} in the safetensors files")
        return self._handles[self.weight_map[name]]

    def shape(self, name: str) -> tuple:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(
            self._handle(name).get_slice(name).get_dtype(), self._handle(name).get_slice(name).get_dtype()
        )

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


class SafetensorsWriter:
    """Add tensors in order; :meth:`close` writes the last shard and the index."""

    def __init__(self, directory: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: Dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: List[Dict[str, int]] = []  # per written shard: name -> bytes
        self.total_bytes = 0
        self.num_tensors = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        if name in self._pending or any(name in s for s in self._shards):
            raise ValueError(f"tensor {name!r} added twice")
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.num_tensors += 1

    def _flush(self) -> None:
        from safetensors.torch import save_file

        index = len(self._shards)
        save_file(self._pending, os.path.join(self.directory, f"shard-{index:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append({k: v.numel() * v.element_size() for k, v in self._pending.items()})
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> List[str]:
        """Write what is pending, name the files; returns the file names written."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for i, name in enumerate(names):
            os.replace(os.path.join(self.directory, f"shard-{i:05d}.tmp"), os.path.join(self.directory, name))
        if count > 1:
            weight_map = {k: names[i] for i, shard in enumerate(self._shards) for k in shard}
            write_json(
                os.path.join(self.directory, INDEX_FILE),
                {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map},
            )
        return names


def parse_size(text: Optional[str]) -> int:
    """``"5GB"``, ``"500MB"``, ``"1024"`` (bytes) -> bytes."""
    if text is None:
        return DEFAULT_MAX_SHARD_BYTES
    units = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "TB": 1024**4, "B": 1}
    t = str(text).strip().upper()
    for unit, factor in units.items():
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise ConversionError(
            f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or a byte count"
        ) from None
