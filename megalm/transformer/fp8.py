"""FP8 training through Transformer Engine: the delayed-scaling recipe of ``--fp8-*`` and the
``fp8_autocast`` region the transformer layers run in.

:class:`megalm.transformer.transformer_block.TransformerBlock` enters :func:`fp8_autocast` around
its layers in every forward (training and evaluation; not KV-cache generation), so every pipeline
stage and virtual chunk is covered and the final norm / output layer stay in bf16, as in
Megatron-LM.  Only TE modules compute in fp8 (their GEMMs); MoE experts and everything
outside TE's layers keep the model's precision.

Communication: TE reduces (max) the amax statistics of the region's fp8 tensors over
``fp8_group``, the tensor x data-parallel group of this pipeline stage (Megatron's amax
reduction group), so every rank of a stage uses the same scaling factors; when exactly
(region exit, backward hooks) depends on the TE version.
"""

from __future__ import annotations

import importlib
from typing import Callable, ContextManager, Optional

from megalm.config.sections import ConfigError
from megalm.fusions import backends


def fp8_recipe(model_cfg):
    """TE's ``DelayedScaling`` for ``--fp8-format`` / ``--fp8-margin`` / ``--fp8-amax-history-len`` /
    ``--fp8-amax-compute-algo`` (e4m3 -> ``Format.E4M3``, hybrid -> ``Format.HYBRID``)."""
    m = model_cfg
    recipe = importlib.import_module("transformer_engine.common.recipe")
    formats = {"e4m3": recipe.Format.E4M3, "hybrid": recipe.Format.HYBRID}
    if m.fp8_format not in formats:
        raise ConfigError(f"unknown --fp8-format {m.fp8_format!r}; expected one of {sorted(formats)}")
    return recipe.DelayedScaling(
        margin=m.fp8_margin,
        fp8_format=formats[m.fp8_format],
        amax_history_len=m.fp8_amax_history_len,
        amax_compute_algo=m.fp8_amax_compute_algo,
    )


def fp8_autocast(model_cfg, amax_group) -> Optional[Callable[[], ContextManager]]:
    """A factory of ``te.fp8_autocast(enabled=True, fp8_recipe=..., fp8_group=amax_group)`` regions
    for ``--fp8-format``, or None when fp8 is off.  ``amax_group``: where TE reduces the amax
    history, the tensor x data x context-parallel group of this pipeline stage (``ProcessGroups.tp_dp_cp``;
    None: this rank alone, TE's default).  The recipe is built once."""
    if model_cfg.fp8_format is None:
        return None
    te = backends.transformer_engine_module()
    if te is None:
        raise backends.BackendUnavailable(f"--fp8-format needs Transformer Engine: {backends.TE_INSTALL}")
    recipe = fp8_recipe(model_cfg)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=amax_group)
