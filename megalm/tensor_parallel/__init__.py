"""Tensor-parallel building blocks: communication mappings, parallel layers, vocab-parallel
cross entropy, RNG streams with recomputation, gradient reductions and layout-independent
initialization."""

from megalm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalm.tensor_parallel.grads import allreduce_sequence_parallel_grads
from megalm.tensor_parallel.initialization import initialize_weights, mark_init
from megalm.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megalm.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megalm.tensor_parallel.param_info import ParamInfo, param_info, set_param_info
from megalm.tensor_parallel.random import (
    RNGStatesTracker,
    checkpoint,
    dropout,
    get_all_rng_states,
    model_parallel_manual_seed,
    set_all_rng_states,
)
from megalm.tensor_parallel.utils import (
    gather_tensor_parallel_grad,
    gather_tensor_parallel_param,
    set_tensor_model_parallel_attributes,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "allreduce_sequence_parallel_grads",
    "initialize_weights",
    "mark_init",
    "copy_to_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "checkpoint",
    "dropout",
    "get_all_rng_states",
    "RNGStatesTracker",
    "model_parallel_manual_seed",
    "set_all_rng_states",
    "gather_tensor_parallel_grad",
    "gather_tensor_parallel_param",
    "set_tensor_model_parallel_attributes",
    "ParamInfo",
    "param_info",
    "set_param_info",
]
