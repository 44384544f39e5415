"""The configuration: one typed dataclass per flag group, one field per Megatron-LM flag, each
in its own module with the checks that need nothing but its own fields (``validate()``):

* :mod:`megalm.config.model` (``ModelConfig``; its MoE checks in :mod:`megalm.config.moe`),
* :mod:`megalm.config.parallel` (``ParallelConfig``),
* :mod:`megalm.config.training` (``TrainingConfig``; its schedule checks in
  :mod:`megalm.config.lr_schedule` and :mod:`megalm.config.batch_schedule`),
* :mod:`megalm.config.data`, :mod:`megalm.config.checkpoint`, :mod:`megalm.config.logs`,
  :mod:`megalm.config.megatron_compat`.

Each field's name is the flag with ``--`` dropped and dashes turned into underscores, unless
``metadata["flag"]`` says otherwise (used for negated flags such as ``--disable-bias-linear``
-> ``add_bias_linear``).  ``help`` in the metadata is the field's documentation and the
flag's ``--help`` text.  Checks across sections: :mod:`megalm.config.cross`; the order and the
freeze: :func:`megalm.config.validation.validate_config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megalm.config.checkpoint import CheckpointConfig
from megalm.config.data import DataConfig
from megalm.config.fields import ConfigError, Section
from megalm.config.logs import LoggingConfig
from megalm.config.megatron_compat import MegatronCompatConfig
from megalm.config.model import ModelConfig
from megalm.config.parallel import ParallelConfig
from megalm.config.training import TrainingConfig

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "MegalmConfig",
    "MegatronCompatConfig",
    "ModelConfig",
    "ParallelConfig",
    "TrainingConfig",
]


@dataclass
class MegalmConfig(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    megatron_compat: MegatronCompatConfig = field(default_factory=MegatronCompatConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MegalmConfig":
        kwargs = {}
        for f in dataclasses.fields(cls):
            sub = f.default_factory
            known = {g.name for g in dataclasses.fields(sub)}
            kwargs[f.name] = sub(**{k: v for k, v in d.get(f.name, {}).items() if k in known})
        return cls(**kwargs)

    def freeze(self) -> None:
        """Make this config and every section read-only (the end of validation)."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).freeze()
        super().freeze()


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(MegalmConfig)}
