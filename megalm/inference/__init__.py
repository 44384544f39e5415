"""Text generation: KV cache (:mod:`.kv_cache`), sampling (:mod:`.sampling`), the batched loop,
checkpoint loading and tensor/pipeline-parallel generation (:mod:`.generation`)."""

from megalm.inference.generation import (
    GenerationOutput,
    generate,
    generate_batch,
    generation_config,
    load_model,
    load_model_parallel,
    tokenizer_for,
)
from megalm.inference.kv_cache import KVCache
from megalm.inference.sampling import SamplingParams, filter_logits, sample_next

__all__ = [
    "GenerationOutput",
    "generate",
    "generate_batch",
    "generation_config",
    "load_model",
    "load_model_parallel",
    "tokenizer_for",
    "KVCache",
    "SamplingParams",
    "filter_logits",
    "sample_next",
]
