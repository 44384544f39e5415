"""Validation: :func:`validate_config` runs each section's own checks (``validate()`` next to its
definition), then the checks across sections (:mod:`megalm.config.cross`), then freezes the config:
every later assignment raises :class:`dataclasses.FrozenInstanceError`.  It runs before any process
group or model exists; errors are :class:`ConfigError` naming the flags."""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from megalm.config.cross import pad_vocab_size, step_schedule, validate_cross
from megalm.config.gptoss import validate_gptoss
from megalm.config.lr_schedule import DECAY_STYLES, WSD_DECAY_STYLES, lr_schedule_samples
from megalm.config.megatron_compat import NO_EFFECT, given_no_effect_flags
from megalm.config.model_checks import RECOMPUTE_MODULES
from megalm.config.moe import validate_moe_routing_recipes as _validate_moe_routing_recipes
from megalm.config.sections import MegalmConfig
from megalm.log import get_logger

__all__ = [
    "DECAY_STYLES",
    "MEGATRON_NO_OPS",
    "RECOMPUTE_MODULES",
    "WSD_DECAY_STYLES",
    "lr_schedule_samples",
    "pad_vocab_size",
    "replace_config",
    "set_vocab_size",
    "step_schedule",
    "validate_config",
    "with_vocab_size",
    "_validate_moe_routing_recipes",
]

logger = get_logger(__name__)

# Megatron-LM flags that have no meaning in megalm: accepted so Megatron scripts run unchanged,
# with a warning naming what megalm does instead.
MEGATRON_NO_OPS = {
    "--apply-query-key-layer-scaling": "Megatron's fp16 overflow guard inside its fused softmax; megalm's "
    "attention scales q k^T by 1/sqrt(head dim) only",
    "--log-throughput": "megalm always logs tokens per second, TFLOP/s per rank and MFU",
    "--log-validation-ppl-to-tensorboard": "megalm always logs validation perplexity (lm loss <split> ppl)",
    **NO_EFFECT,
}


def validate_config(cfg: MegalmConfig, world_size: Optional[int] = None) -> MegalmConfig:
    """Check every flag and combination, fill the derived values, freeze, and return the config.

    Sections first (model, parallel, training, data, checkpoint, logging, Megatron compatibility:
    each one's ``validate()``), then the checks across sections.  A config not validated yet is
    validated in place; one already validated (frozen) is copied and the copy is validated and
    returned.  Raises :class:`ConfigError`."""
    if cfg.frozen or any(getattr(cfg, f.name).frozen for f in dataclasses.fields(cfg)):
        cfg = copy.deepcopy(cfg)  # copies do not carry the freeze
    validate_gptoss(cfg.model, cfg.parallel)  # yarn spelling -> rope + YaRN, window/sink refusals
    cfg.model.validate()
    cfg.parallel.validate()
    cfg.training.validate()
    cfg.data.validate()
    cfg.checkpoint.validate()
    cfg.logging.validate(world_size)
    cfg.megatron_compat.validate()
    validate_cross(cfg, world_size)
    _warn_megatron_no_ops(cfg)
    cfg.freeze()
    return cfg


def _warn_megatron_no_ops(cfg: MegalmConfig) -> None:
    """One warning line naming every Megatron-LM flag given that has no effect here, and why."""
    given = [
        flag
        for flag, value in (
            ("--apply-query-key-layer-scaling", cfg.model.apply_query_key_layer_scaling),
            ("--log-throughput", cfg.logging.log_throughput),
            ("--log-validation-ppl-to-tensorboard", cfg.logging.log_validation_ppl_to_tensorboard),
        )
        if value
    ] + given_no_effect_flags(cfg.megatron_compat)
    if given:
        reasons = "; ".join(f"{flag} ({MEGATRON_NO_OPS[flag]})" for flag in given)
        logger.warning("Megatron-LM flags with no effect in megalm: %s", reasons)


def set_vocab_size(cfg: MegalmConfig, vocab_size: int) -> None:
    """Record the tokenizer's vocabulary size and the padded size used by the embedding, in a config
    not validated yet (or a copy).  A validated (frozen) config cannot change: use
    :func:`with_vocab_size`, which returns a new one; on a frozen config this accepts only the
    values it already holds."""
    padded = pad_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    if cfg.model.frozen and (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (vocab_size, padded):
        return
    cfg.model.vocab_size = vocab_size
    cfg.model.padded_vocab_size = padded


def replace_config(cfg: MegalmConfig, **sections: dict) -> MegalmConfig:
    """A frozen copy of the validated ``cfg`` with fields of some sections replaced, e.g.
    ``replace_config(cfg, data={"tokenizer_type": "NullTokenizer"})``; the other sections are
    shared, unchanged.  For facts known only after validation (the tokenizer's vocabulary, a
    tokenizer written by a converter); a change that needs checking goes through
    :func:`validate_config` again instead."""
    changed = {name: dataclasses.replace(getattr(cfg, name), **fields) for name, fields in sections.items()}
    out = dataclasses.replace(cfg, **changed)
    out.freeze()
    return out


def with_vocab_size(cfg: MegalmConfig, vocab_size: int, **data_fields) -> MegalmConfig:
    """A frozen copy of the validated ``cfg`` with the vocabulary the tokenizer reports (and the
    padded size), and ``data_fields`` of the data section replaced (e.g. the tokenizer type chosen
    for ``--vocab-size`` alone)."""
    padded = pad_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)
    changes = {"model": {"vocab_size": vocab_size, "padded_vocab_size": padded}}
    if data_fields:
        changes["data"] = data_fields
    return replace_config(cfg, **changes)
