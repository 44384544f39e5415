"""Text generation: KV cache (:mod:`.kv_cache`), sampling (:mod:`.sampling`), the loop and
checkpoint loading (:mod:`.generation`).  Single process (TP 1, PP 1) for now."""

from megalm.inference.generation import GenerationOutput, generate, load_model, tokenizer_for
from megalm.inference.kv_cache import KVCache
from megalm.inference.sampling import SamplingParams, filter_logits, sample_next

__all__ = ["GenerationOutput", "generate", "load_model", "tokenizer_for", "KVCache", "SamplingParams",
           "filter_logits", "sample_next"]
