"""Autoregressive generation with a GPTModel (single process, TP 1, PP 1).

:func:`generate` runs the prompt once through the model filling a :class:`KVCache`, then feeds
one token per step (``use_cache=False`` re-runs the whole sequence each step instead; it
exists to check the cache).  It stops after ``max_new_tokens`` or at ``eod`` (the EOD token
is kept in the returned ids, as ``transformers`` does).  With learned absolute positions the
sequence cannot exceed ``max_position_embeddings``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from megalm.inference.kv_cache import KVCache
from megalm.inference.sampling import SamplingParams, sample_next


@dataclass
class GenerationOutput:
    prompt_ids: List[int]
    generated_ids: List[int]
    stopped_at_eod: bool = False
    step_logits: List[torch.Tensor] = field(default_factory=list)  # [V] fp32 per step, when asked for


def max_sequence_length(model) -> Optional[int]:
    """The most positions the model can embed (learned absolute positions), else None."""
    m = model.cfg.model
    return m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else None


def _last_logits(model, tokens: torch.Tensor, cache: Optional[KVCache]) -> torch.Tensor:
    logits = model(tokens, inference_cache=cache) if cache is not None else model(tokens)
    logits = logits[:, -1, :model.vocab_size]  # drop vocabulary padding
    return logits if logits.dtype == torch.float64 else logits.float()


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int, params: Optional[SamplingParams] = None,
             eod: Optional[int] = None, generator: Optional[torch.Generator] = None, use_cache: bool = True,
             return_logits: bool = False) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (model must be in eval mode)."""
    params = (params or SamplingParams()).validate()
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty (no tokens)")
    if model.training:
        raise ValueError("generate() needs the model in eval mode (dropout off): call model.eval()")
    limit = max_sequence_length(model)
    total = len(prompt) + max_new_tokens
    if limit is not None and total > limit:
        raise ValueError(f"prompt ({len(prompt)} tokens) + --max-new-tokens {max_new_tokens} = {total} exceeds "
                         f"the model's {limit} learned positions")
    device = next(model.parameters()).device
    out = GenerationOutput(prompt, [])
    if max_new_tokens <= 0:
        return out
    cache = KVCache(total) if use_cache else None
    sequence = torch.tensor([prompt], dtype=torch.long, device=device)
    logits = _last_logits(model, sequence, cache)
    for step in range(max_new_tokens):
        if return_logits:
            out.step_logits.append(logits[0].cpu())
        token = sample_next(logits, params, generator)  # [1]
        token_id = int(token.item())
        out.generated_ids.append(token_id)
        if eod is not None and token_id == eod:
            out.stopped_at_eod = True
            break
        if step == max_new_tokens - 1:
            break
        sequence = torch.cat([sequence, token.view(1, 1).to(device)], dim=1)
        logits = _last_logits(model, token.view(1, 1).to(device) if use_cache else sequence, cache)
    return out


def load_model(load_dir: str, iteration: Optional[int] = None, dtype: torch.dtype = torch.float32):
    """GPTModel (TP 1, PP 1, eval mode) and its config from a checkpoint saved under any layout."""
    from megalm.conversion.megalm_checkpoint import MegalmCheckpointReader
    from megalm.conversion.verify import megalm_model_from_tensors

    reader = MegalmCheckpointReader(load_dir, iteration)
    cfg = copy.deepcopy(reader.config)
    if cfg.model.vocab_size is None:
        raise ValueError(f"{reader.path}/common.json: the config has no vocab_size")
    model = megalm_model_from_tensors(cfg, reader.load(reader.model_names), dtype=dtype)
    return model.eval(), model.cfg, reader


def tokenizer_for(cfg, tokenizer_type: Optional[str] = None, tokenizer_model: Optional[str] = None,
                  vocab_size: Optional[int] = None):
    """The tokenizer named by the flags, else the one in the checkpoint's config."""
    from megalm.tokenizers.build import create_tokenizer

    kind = tokenizer_type or cfg.data.tokenizer_type
    model_file = tokenizer_model or (cfg.data.tokenizer_model if tokenizer_type in (None, cfg.data.tokenizer_type)
                                     else None)
    if kind is None:
        raise ValueError("the checkpoint's config names no tokenizer: pass --tokenizer-type (and --tokenizer-model)")
    if kind == "NullTokenizer" and vocab_size is None:
        vocab_size = cfg.model.vocab_size - 1  # the saved vocab_size is the tokenizer's (ids + EOD)
    tokenizer = create_tokenizer(kind, model_file, vocab_size)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"tokenizer vocabulary {tokenizer.vocab_size} is larger than the model's "
                         f"{cfg.model.vocab_size}")
    return tokenizer
