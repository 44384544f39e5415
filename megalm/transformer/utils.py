"""Small helpers shared by the transformer modules: init standard deviations and the
effective sequence-parallel switch."""

from __future__ import annotations

import math

from megalm.tensor_parallel.utils import sequence_parallel_enabled


def init_std(model_cfg) -> float:
    """``--init-method-std``: weights and embeddings."""
    return model_cfg.init_method_std


def recompute_modules(model_cfg) -> frozenset:
    """What ``--recompute-granularity selective`` recomputes: ``--recompute-modules`` (Megatron's names),
    by default the attention core; nothing without selective recomputation."""
    if model_cfg.recompute_granularity != "selective":
        return frozenset()
    return frozenset(model_cfg.recompute_modules or ("core_attn",))


def output_init_std(model_cfg) -> float:
    """Output projections (attention ``linear_proj``, MLP ``linear_fc2``): ``std / sqrt(2 L)``
    with ``--use-scaled-init-method`` (the default), else ``std``."""
    if model_cfg.use_scaled_init_method:
        return model_cfg.init_method_std / math.sqrt(2.0 * model_cfg.num_layers)
    return model_cfg.init_method_std


__all__ = ["init_std", "output_init_std", "recompute_modules", "sequence_parallel_enabled"]
