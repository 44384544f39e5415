"""Typed configuration, the command line built from it, and validation in one place.

* :mod:`megalm.config.sections`: the dataclasses (``ModelConfig``, ``ParallelConfig``, ...,
  ``MegalmConfig``), one field per Megatron-LM flag;
* :mod:`megalm.config.cli`: the argparse parser built from them and :func:`parse_config`;
* :mod:`megalm.config.validation`: :func:`validate_config`, the only place where
  combinations are checked (before any process group or model exists).
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
from megalm.config.validation import pad_vocab_size, set_vocab_size, validate_config

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
    "set_vocab_size",
    "validate_config",
]
