"""Mixture of experts with expert parallelism (Megatron-LM's ``--num-experts`` / ``--moe-*``).

One idea per file: ``router`` (top-k routing, auxiliary losses), ``capacity`` (token dropping
and padding), ``aux_losses`` (formulas and the backward scaler), ``tracker`` (metrics for the
log), ``state`` (a model's metrics and aux-loss scale), ``mappings`` (the expert-parallel
all-to-all), ``token_dispatcher`` (allgather / alltoall), ``experts`` (local expert MLPs, looped
or grouped), ``moe_layer`` (the block).
"""

from megalm.transformer.moe.aux_losses import MoEAuxLossAutoScaler
from megalm.transformer.moe.moe_layer import (
    MoELayer,
    begin_training_step,
    is_moe_layer,
    moe_layer_pattern,
    pop_moe_metrics,
    share_moe_state,
)
from megalm.transformer.moe.state import MoEState

__all__ = [
    "MoEAuxLossAutoScaler",
    "MoELayer",
    "MoEState",
    "begin_training_step",
    "is_moe_layer",
    "moe_layer_pattern",
    "pop_moe_metrics",
    "share_moe_state",
]
