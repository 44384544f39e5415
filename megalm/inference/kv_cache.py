"""Key/value cache for incremental decoding.

Each transformer layer keeps its keys and values (after RoPE) for all positions seen so far,
preallocated ``[max_length, b, groups, head_dim]``; a forward with ``s`` new tokens writes
positions ``offset .. offset+s-1`` and attends over ``0 .. offset+s-1``, so a generated token
costs one position, not a re-forward of the whole sequence.  :meth:`KVCache.advance` (called
by :meth:`megalm.models.GPTModel.forward`) moves ``offset`` once all layers have run.

Under model parallelism each rank's cache holds what its piece of the model computes: the layers
of its pipeline stage (keyed by global layer number) and the query groups of its TP rank.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


class LayerKVCache:
    """One layer's keys/values; ``offset`` is shared with (read from) the owning :class:`KVCache`."""

    def __init__(self, owner: "KVCache"):
        self.owner = owner
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    @property
    def offset(self) -> int:
        return self.owner.offset

    def update(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``[s_new, b, ...]`` (``[s_new, b, groups, d]`` for self-attention) at ``offset``;
        return all ``offset + s_new`` positions."""
        start, end = self.offset, self.offset + k.shape[0]
        if end > self.owner.max_length:
            raise ValueError(f"KV cache holds {self.owner.max_length} positions, asked for {end}")
        if self.keys is None:  # k and v may differ in shape (MLA caches its latent and its RoPE key)
            self.keys = torch.empty((self.owner.max_length,) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
            self.values = torch.empty((self.owner.max_length,) + tuple(v.shape[1:]), dtype=v.dtype, device=v.device)
        self.keys[start:end] = k
        self.values[start:end] = v
        return self.keys[:end], self.values[:end]


class KVCache:
    """Per-layer caches keyed by the global layer number, and the number of cached positions."""

    def __init__(self, max_length: int):
        self.max_length = int(max_length)
        self.offset = 0
        self._layers: Dict[int, LayerKVCache] = {}

    def layer(self, layer_number: int) -> LayerKVCache:
        if layer_number not in self._layers:
            self._layers[layer_number] = LayerKVCache(self)
        return self._layers[layer_number]

    def advance(self, num_tokens: int) -> None:
        self.offset += int(num_tokens)
