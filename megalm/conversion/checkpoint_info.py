"""Describe a megalm checkpoint from its metadata alone (no tensor is read).

:func:`describe` gathers the iteration, samples consumed, the layout it was saved with, the
config, every tensor's global shape and dtype (from DCP's ``.metadata``, read by
:mod:`megalm.checkpoint.safe_metadata`) and parameter / byte totals; :func:`format_description` renders it.
"""

from __future__ import annotations

import math
import re
from typing import List, Optional

from megalm.conversion.errors import ConversionError
from megalm.conversion.megalm_checkpoint import MODEL_PREFIX, MegalmCheckpointReader


def _natural(name: str) -> list:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _numel(shape) -> int:
    return int(math.prod(shape)) if shape else 1


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe(root: str, iteration: Optional[int] = None) -> dict:
    reader = MegalmCheckpointReader(root, iteration)
    common = reader.common
    tensors = [
        {
            "name": k,
            "shape": list(shape),
            "dtype": _dtype_name(dtype),
            "numel": _numel(shape),
            "bytes": _numel(shape) * dtype.itemsize,
        }
        for k, (shape, dtype) in sorted(reader.entries.items(), key=lambda kv: _natural(kv[0]))
    ]
    model = [t for t in tensors if t["name"].startswith(MODEL_PREFIX)]
    other = [t for t in tensors if not t["name"].startswith(MODEL_PREFIX)]
    try:
        from megalm.conversion.architectures import for_megalm

        architecture = for_megalm(reader.config.model).hf_class
    except ConversionError as e:
        architecture = f"none ({e})"
    return {
        "path": reader.path,
        "iteration": common.get("iteration"),
        "consumed_train_samples": common.get("consumed_train_samples"),
        "consumed_valid_samples": common.get("consumed_valid_samples"),
        "world_size": common.get("world_size"),
        "layout": common.get("layout"),
        "config": common.get("config"),
        "extra": common.get("extra") or {},
        "has_optimizer_state": bool(other),
        "hf_architecture": architecture,
        "model_tensors": model,
        "other_tensors": other,
        "total_parameters": sum(t["numel"] for t in model),
        "model_bytes": sum(t["bytes"] for t in model),
        "other_bytes": sum(t["bytes"] for t in other),
    }


def _config_lines(config: dict, sections: List[str]) -> List[str]:
    lines = []
    for section in sections:
        values = config.get(section) or {}
        items = [f"{k}={v}" for k, v in values.items() if v is not None and v is not False]
        lines.append(f"  {section}: " + ", ".join(items))
    return lines


def format_description(info: dict, all_tensors: bool = False, full_config: bool = False) -> str:
    gib = 2**30
    layout = info["layout"] or {}
    lines = [
        f"checkpoint: {info['path']}",
        f"iteration: {info['iteration']} | consumed samples: train {info['consumed_train_samples']}, "
        f"valid {info['consumed_valid_samples']}",
        "saved with: "
        + ", ".join(f"{k.replace('_model_parallel_size', '').replace('_size', '')} {v}" for k, v in layout.items())
        + f" (world size {info['world_size']})",
        f"Hugging Face architecture: {info['hf_architecture']}",
    ]
    if info["extra"]:
        lines.append("extra: " + ", ".join(f"{k}={v}" for k, v in info["extra"].items()))
    lines.append("config:")
    sections = list(info["config"] or {}) if full_config else ["model", "parallel"]
    lines += _config_lines(info["config"] or {}, sections)
    lines.append(
        f"model tensors ({len(info['model_tensors'])}, {info['total_parameters']:,} parameters, "
        f"{info['model_bytes'] / gib:.3f} GiB):"
    )
    width = max([len(t["name"]) for t in info["model_tensors"]] + [10])
    for t in info["model_tensors"]:
        lines.append(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']}")
    n_other = len(info["other_tensors"])
    lines.append(
        f"optimizer tensors: {n_other} ({info['other_bytes'] / gib:.3f} GiB)"
        + ("" if n_other else " (weights only: load with --finetune or --no-load-optim)")
    )
    if all_tensors:
        for t in info["other_tensors"]:
            lines.append(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<20} {t['dtype']}")
    return "\n".join(lines)
