"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from megalm.config.sections import ConfigError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter

    def validate(self) -> "SamplingParams":
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """``logits`` ``[..., V]`` with everything outside the top-k / top-p set at ``-inf``.

    Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p``
    (always at least the most likely one).
    """
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability mass strictly before each token
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: Union[None, torch.Generator, Sequence[Optional[torch.Generator]]] = None,
) -> torch.Tensor:
    """Next token ids ``[b]`` from fp32 logits ``[b, V]``.

    ``generator``: one generator for the whole batch (one ``multinomial`` draw over all rows), or a
    sequence of ``b`` generators, one per row: row ``i`` then draws from ``generator[i]`` alone,
    exactly as a batch of one with that generator would, so a row's tokens do not depend on the
    other rows.  Greedy decoding draws nothing.
    """
    logits = logits.float()
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = torch.softmax(logits, dim=-1)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    generators = list(generator)
    if len(generators) != probs.shape[0]:
        raise ValueError(f"{len(generators)} generators for {probs.shape[0]} rows of logits")
    return torch.cat([torch.multinomial(probs[i : i + 1], 1, generator=g).view(1) for i, g in enumerate(generators)])
