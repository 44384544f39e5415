"""Hugging Face directory -> megalm checkpoint, loadable under any TP/PP layout.

The model config comes from ``config.json`` (each unmappable field is refused by name),
everything else from megalm flags (``extra_args``: the same flags as ``pretrain_gpt.py``;
``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` /
``--expert-model-parallel-size`` are recorded as the intended layout and validated against the
model).  Architecture flags given there must agree
with ``config.json``.  Tensors are written full, from this one process, so any layout loads
them; the checkpoint has no optimizer state: train from it with ``--load DIR --finetune``
(weights only, iteration 0) or ``--no-load-optim``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from megalm.config import ConfigError, MegalmConfig, build_parser, config_from_args, replace_config, validate_config
from megalm.conversion.architectures import for_hf
from megalm.conversion.base import VOCAB_ROWS, checkpoint_shapes, router_buffer_shapes
from megalm.conversion.errors import ConversionError
from megalm.conversion.hf_files import DTYPES, HFWeights, read_config
from megalm.conversion.megalm_checkpoint import write_checkpoint
from megalm.conversion.tokenizer_files import import_tokenizer


@dataclass
class ImportResult:
    path: str
    architecture: str
    config: MegalmConfig
    num_tensors: int
    num_parameters: int
    notes: List[str] = field(default_factory=list)


def _explicit_dests(parser, argv: Sequence[str]) -> Dict[str, str]:
    """``{dest: flag}`` for every flag that appears in ``argv``."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return {action.dest: flag for action in parser._actions for flag in action.option_strings if flag in given}


def build_config(fields: dict, extra_args: Sequence[str], overridable: Sequence[str] = ()) -> MegalmConfig:
    """megalm config: flags from ``extra_args``, the model architecture from ``fields`` (HF), validated.

    ``--vocab-size N`` in ``extra_args`` (at most config.json's) trims embedding rows beyond the
    tokenizer's vocabulary, for HF models whose embedding was padded.  Fields named in
    ``overridable`` (training-only settings) take the flag's value when the flag is given.
    """
    parser = build_parser("megalm import", exit_on_error=False)
    try:
        args = parser.parse_args(list(extra_args))
    except ConfigError as e:
        raise ConversionError(f"cannot parse the megalm flags {list(extra_args)}: {e}") from None
    cfg = config_from_args(args)
    explicit = _explicit_dests(parser, extra_args)
    vocab_size = cfg.model.vocab_size if "model.vocab_size" in explicit else None
    given = dataclasses.asdict(cfg.model)
    unknown = sorted(set(fields) - set(given))
    if unknown:
        raise ConversionError(f"the architecture mapping sets {unknown}, which are not megalm model fields")
    for name, value in fields.items():
        dest = f"model.{name}"
        if dest in explicit and name in overridable:
            continue
        if dest in explicit and name != "vocab_size" and given[name] != value:
            raise ConversionError(
                f"{explicit[dest]} {given[name]} disagrees with config.json, which gives "
                f"{name} = {value}; leave architecture flags out when importing"
            )
        setattr(cfg.model, name, value)
    if "model.seq_length" not in explicit:
        cfg.model.seq_length = fields["max_position_embeddings"]
    if vocab_size is not None:
        if vocab_size > fields["vocab_size"]:
            raise ConversionError(
                f"--vocab-size {vocab_size} is larger than config.json vocab_size {fields['vocab_size']}"
            )
        cfg.model.vocab_size = vocab_size
    try:
        return validate_config(cfg)  # sets the padded vocabulary too
    except ConfigError as e:
        raise ConversionError(f"the imported model does not fit the requested layout: {e}") from None


def import_from_hf(
    hf_dir: str, save_dir: str, extra_args: Sequence[str] = (), iteration: int = 0, dtype: Optional[str] = None
) -> ImportResult:
    """Write ``save_dir/iter_<iteration>/`` from the HF model in ``hf_dir``; ``dtype`` casts the
    weights (default: as stored).  ``extra_args``: megalm flags (see :func:`build_config`)."""
    hf = read_config(hf_dir)
    arch = for_hf(hf)
    fields = arch.megalm_fields(hf)
    weights = HFWeights(hf_dir)
    cfg = build_config(fields, extra_args, arch.overridable_fields)
    notes = arch.import_notes(hf)
    if not cfg.data.tokenizer_type:
        tok_type, tok_path, note = import_tokenizer(hf_dir, save_dir)
        cfg = replace_config(cfg, data={"tokenizer_type": tok_type, "tokenizer_model": tok_path})
        notes.append(note)
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    m = cfg.model
    expected = {**checkpoint_shapes(m), **router_buffer_shapes(m)}
    tensors: Dict[str, torch.Tensor] = {}
    for name, tensor in arch.to_megalm(m, weights.get, weights.keys()):
        if name in VOCAB_ROWS and tensor.shape[0] > m.vocab_size:
            tensor = tensor[: m.vocab_size]
        if name not in expected:
            raise ConversionError(f"internal: the {arch.name} mapping produced an unknown tensor {name}")
        if tuple(tensor.shape) != expected[name]:
            raise ConversionError(
                f"{name}: the Hugging Face weights give shape {tuple(tensor.shape)}, config.json "
                f"implies {expected[name]}"
            )
        tensors[name] = tensor.to(DTYPES[dtype]) if dtype else tensor
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ConversionError(f"internal: the {arch.name} mapping left out {missing[:3]}")
    extra = {"converted_from": os.path.abspath(hf_dir), "hf_architecture": arch.hf_class}
    path = write_checkpoint(save_dir, iteration, tensors, cfg, extra)
    return ImportResult(path, arch.hf_class, cfg, len(tensors), sum(t.numel() for t in tensors.values()), notes)
