"""Expert capacity: which routed tokens an over-full expert keeps (and optional padding).

Dropless by default.  With ``--moe-expert-capacity-factor f`` each expert accepts at most

    capacity = ceil(T * topk / E * f)            (T tokens of this rank, E experts; Megatron's get_capacity)

of this rank's tokens, counted before the tokens leave the rank (so per source rank and expert;
under context parallelism the router applies it to the whole sequence of the CP group instead,
:mod:`~megalm.transformer.moe.router`).
The kept tokens of expert ``e`` are the first ``capacity`` in an order that depends on
``--moe-token-drop-policy``:

* ``probs``: routed tokens by decreasing router probability (ties: earlier position first);
* ``position``: routed tokens by position (token index ``t = s_index * b + b_index``).

A dropped (token, expert) pair gets probability 0 and is not sent; a token dropped by all its
experts contributes nothing to the MoE output (the residual connection carries it).

``--moe-pad-expert-input-to-capacity``: every expert receives exactly ``min(capacity, T)``
tokens from every rank: the routing map is extended with filler tokens of probability 0 (the
earliest-position tokens not routed to that expert), as Megatron pads with zero-probability
tokens.  Fillers are computed like any token and weighted by 0, so the output and gradients
are those of dropping; only the shapes become static.

No communication.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from megalm.config.sections import ConfigError


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """``ceil(num_tokens * topk / num_experts * capacity_factor)`` (Megatron's ``get_capacity``)."""
    return int(math.ceil((num_tokens * topk / num_experts) * capacity_factor))


def keep_order_ranks(probs: torch.Tensor, routing_map: torch.Tensor, policy: str) -> torch.Tensor:
    """``rank[t, e]``: place of token ``t`` in expert ``e``'s keep order (0 = kept first).

    Routed tokens come first (by decreasing probability for ``probs``, by position for
    ``position``), then the tokens not routed to ``e`` by position.
    """
    if policy == "probs":
        key = torch.where(routing_map, probs.float(), torch.full_like(probs, -1.0, dtype=torch.float32))
    elif policy == "position":
        key = routing_map.float()
    else:
        raise ConfigError(f"unknown --moe-token-drop-policy {policy!r}; expected probs or position")
    order = torch.sort(key, dim=0, descending=True, stable=True).indices  # [T, E]
    positions = torch.arange(key.shape[0], device=key.device).unsqueeze(1).expand_as(order)
    return torch.empty_like(order).scatter_(0, order, positions)


def apply_capacity(
    probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, policy: str = "probs", pad_to_capacity: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Drop (token, expert) pairs beyond ``capacity`` per expert; returns ``(probs, routing_map)``.

    ``probs`` ``[T, E]`` holds the routing probabilities (0 where not routed), ``routing_map``
    ``[T, E]`` bool.  With ``pad_to_capacity`` the returned map has exactly ``min(capacity, T)``
    entries per expert (fillers have probability 0).
    """
    rank = keep_order_ranks(probs.detach(), routing_map, policy)
    within = rank < min(capacity, routing_map.shape[0])
    kept = routing_map & within
    new_map = within if pad_to_capacity else kept
    return probs * kept.to(probs.dtype), new_map
