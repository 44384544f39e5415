"""megalm checkpoint -> Hugging Face directory (``config.json`` + safetensors + tokenizer).

Reads one iteration of a checkpoint saved under any TP/PP/EP/DP layout (the tensors are stored
layout-independently, experts by global index), a layer at a time, and streams the mapped tensors into safetensors
shards, so memory holds about one layer plus one shard.  Weights come from the fp32 main
copies when the checkpoint has them (mixed precision) and are written in ``dtype``
(default: the dtype the model was trained in).  The vocabulary in the checkpoint is already
the tokenizer's (padding rows are never saved).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from megalm.conversion.architectures import for_megalm
from megalm.conversion.base import WORD_EMBEDDINGS, checkpoint_shapes, router_buffer_shapes
from megalm.conversion.errors import ConversionError
from megalm.conversion.hf_files import DEFAULT_MAX_SHARD_BYTES, DTYPE_NAMES, DTYPES, SafetensorsWriter, write_json
from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
from megalm.conversion.tokenizer_files import export_tokenizer


@dataclass
class ExportResult:
    save_dir: str
    architecture: str
    iteration: int
    dtype: str
    num_tensors: int
    total_bytes: int
    files: List[str]
    notes: List[str] = field(default_factory=list)


def _check_shapes(reader: MegalmCheckpointReader, m) -> None:
    expected = {**checkpoint_shapes(m), **router_buffer_shapes(m)}
    missing = [k for k in expected if not reader.has(k)]
    wrong = [f"{k}: {reader.shape(k)} != {v}" for k, v in expected.items() if reader.has(k) and reader.shape(k) != v]
    extra = [k for k in reader.model_names if k not in expected]
    if missing or wrong or extra:
        raise ConversionError(
            f"checkpoint {reader.path} does not match its own config: missing {missing[:3]}, "
            f"wrong shapes {wrong[:3]}, unexpected {extra[:3]}"
        )


def export_to_hf(
    load_dir: str,
    save_dir: str,
    iteration: Optional[int] = None,
    dtype: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_model: Optional[str] = None,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
) -> ExportResult:
    """Write the HF directory ``save_dir`` (created; must be empty) from the megalm checkpoint in ``load_dir``.
    ``tokenizer_model`` / ``vocab_file`` / ``merge_file`` replace the tokenizer paths in its config."""
    reader = MegalmCheckpointReader(load_dir, iteration)
    m = reader.config.model
    if m.vocab_size is None:
        raise ConversionError(f"{reader.path}/common.json: the config has no vocab_size")
    arch = for_megalm(m)
    _check_shapes(reader, m)
    saved_dtype = reader.dtype(WORD_EMBEDDINGS)
    dtype_name = dtype or DTYPE_NAMES.get(saved_dtype, "float32")
    if dtype_name not in DTYPES:
        raise ConversionError(f"--dtype {dtype_name!r}: choose one of {', '.join(DTYPES)}")
    target = DTYPES[dtype_name]
    if os.path.isdir(save_dir) and os.listdir(save_dir):
        raise ConversionError(f"--save-dir {save_dir} is not empty")
    os.makedirs(save_dir, exist_ok=True)

    d = reader.config.data
    special, tokenizer_note = export_tokenizer(
        d.tokenizer_type,
        save_dir,
        m.max_position_embeddings,
        tokenizer_model or d.tokenizer_model,
        vocab_file or d.vocab_file,
        merge_file or d.merge_file,
    )
    writer = SafetensorsWriter(save_dir, max_shard_bytes)
    for name, tensor in arch.to_hf(m, reader.load):
        writer.add(name, tensor.to(target))
    files = writer.close()
    config = arch.hf_config(m, dtype_name, special)
    write_json(os.path.join(save_dir, "config.json"), config)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    write_json(os.path.join(save_dir, "generation_config.json"), gen)
    return ExportResult(
        save_dir,
        arch.hf_class,
        reader.iteration,
        dtype_name,
        writer.num_tensors,
        writer.total_bytes,
        files,
        [tokenizer_note] + arch.export_notes(m),
    )
