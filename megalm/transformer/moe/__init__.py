"""Mixture of experts with expert parallelism (Megatron-LM's ``--num-experts`` / ``--moe-*``).

One idea per file: ``router`` (top-k routing, auxiliary losses), ``capacity`` (token dropping
and padding), ``aux_losses`` (formulas and the backward scaler), ``tracker`` (metrics for the
log), ``mappings`` (expert-parallel collectives), ``token_dispatcher`` (allgather / alltoall),
``experts`` (local expert MLPs, looped or grouped), ``moe_layer`` (the block).
"""

from megalm.transformer.moe.aux_losses import MoEAuxLossAutoScaler, begin_training_step
from megalm.transformer.moe.moe_layer import MoELayer, is_moe_layer, moe_layer_pattern
from megalm.transformer.moe.tracker import get_moe_tracker, pop_moe_metrics

__all__ = ["MoEAuxLossAutoScaler", "MoELayer", "begin_training_step", "get_moe_tracker", "is_moe_layer",
           "moe_layer_pattern", "pop_moe_metrics"]
