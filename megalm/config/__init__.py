"""Typed configuration, the command line built from it, and its validation.

* :mod:`megalm.config.sections`: ``MegalmConfig`` and its sections (``ModelConfig``,
  ``ParallelConfig``, ...), one module per section, one field per Megatron-LM flag, each section
  with a ``validate()`` for the checks that need only its own fields;
* :mod:`megalm.config.cross`: the checks across sections, in one place;
* :mod:`megalm.config.cli`: the argparse parser built from the sections and :func:`parse_config`;
* :mod:`megalm.config.validation`: :func:`validate_config` (sections, then cross-section checks,
  then the freeze: a validated config is read-only), before any process group or model exists.
See docs/configuration.md.
"""

from megalm.config.cli import add_config_arguments, build_parser, config_from_args, parse_config, parse_moe_layer_freq
from megalm.config.sections import (
    SECTIONS,
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggingConfig,
    MegalmConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
)
from megalm.config.validation import (
    pad_vocab_size,
    replace_config,
    set_vocab_size,
    validate_config,
    with_vocab_size,
)

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "MegalmConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainingConfig",
    "add_config_arguments",
    "build_parser",
    "config_from_args",
    "pad_vocab_size",
    "parse_config",
    "parse_moe_layer_freq",
    "replace_config",
    "set_vocab_size",
    "validate_config",
    "with_vocab_size",
]
