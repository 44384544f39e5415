"""Token dispatchers: bring each routed (token, expert) pair to the rank holding the expert, run
the experts, bring the results back and combine them with the routing probabilities.

Both dispatchers compute, for the ``T`` tokens ``x`` ``[T, h]`` of this rank,

    out[t] = sum over experts e routed for t of probs[t, e] * expert_e(x[t])

with the sum in fp32, cast back to ``x``'s dtype.  Experts are split evenly over the
expert-parallel (EP) group: EP rank ``r`` holds experts ``[r L, (r+1) L)``, ``L = E / EP``.
The EP group joins ranks with the same tensor-parallel rank, and under sequence parallelism
every TP rank dispatches only its own slice of the sequence: no TP communication here.  With
``--expert-tensor-parallel-size`` > 1 the EP group joins ranks with the same expert-tensor rank, the
tokens are those of the whole ETP group (gathered by the MoE layer) and the experts' outputs are
partial sums that the MoE layer reduces over ETP.

``allgather`` (Megatron's MoEAllGatherTokenDispatcher)
    Forward: all-gather over EP of the tokens ``[EP*T, h]`` and of probabilities + routing
    map ``[EP*T, 2E]`` (fp32); each rank selects the pairs of its local experts, computes them,
    weights them and scatter-adds into ``[EP*T, h]``; a reduce-scatter over EP returns each
    rank the sums for its own tokens.
    Backward: all-gather of the output gradient ``[EP*T, h]``; reduce-scatter of the token
    gradient and of the probability gradient.

``alltoall`` (Megatron's MoEAlltoAllTokenDispatcher)
    Forward: pairs are sorted by global expert; an all-gather over EP of the per-expert counts
    (``EP x E`` int64) gives every split size; an all-to-all sends each rank the pairs of its
    experts (uneven splits), which are regrouped by local expert, computed, ungrouped and sent
    back by the reverse all-to-all; the source rank weights them and scatter-adds.
    Backward: the two all-to-alls in reverse (same sizes); nothing for the counts.

With EP 1 both reduce to a local sort by expert.  Split sizes need the counts on the host
(one device-to-host copy per layer and micro-batch).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from megalm.config.sections import ConfigError
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.mappings import (
    all_gather_first_dim,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megalm.transformer.moe.experts import LocalExperts
from megalm.transformer.moe.mappings import all_to_all_expert_parallel


def permute(tokens: torch.Tensor, routing_map: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``tokens`` for every routed pair, sorted by expert then token.

    Returns ``(permuted [N, h], token_index [N], expert_index [N])``.
    """
    expert_index, token_index = routing_map.t().nonzero(as_tuple=True)
    return tokens.index_select(0, token_index), token_index, expert_index


def unpermute(
    expert_out: torch.Tensor, weights: torch.Tensor, token_index: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``out[t] = sum of weights[n] * expert_out[n] over pairs n of token t`` (fp32) ``[num_tokens, h]``."""
    weighted = expert_out.float() * weights.float().unsqueeze(-1)
    return weighted.new_zeros(num_tokens, expert_out.shape[-1]).index_add(0, token_index, weighted)


class AllGatherTokenDispatcher:
    """See the module docstring (``allgather``); communicates over ``ep_group``."""

    def __init__(self, ep_group) -> None:
        self.ep_group = ep_group

    def __call__(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: LocalExperts
    ) -> torch.Tensor:
        num_experts = routing_map.shape[1]
        local = slice(experts.first, experts.first + experts.count)
        all_tokens = gather_from_sequence_parallel_region(tokens, self.ep_group)
        if group_size(self.ep_group) > 1:
            # Probabilities and the routing map travel together in one fp32 all-gather.
            routing = torch.cat([probs.float(), routing_map.float()], dim=1)
            routing = gather_from_sequence_parallel_region(routing, self.ep_group)
            all_probs, all_map = routing[:, :num_experts], routing[:, num_experts:].detach() > 0.5
        else:
            all_probs, all_map = probs, routing_map
        local_map = all_map[:, local]
        permuted, token_index, expert_index = permute(all_tokens, local_map)
        counts = local_map.sum(0).tolist()
        expert_out = experts(permuted, counts)
        weights = all_probs[:, local][token_index, expert_index]
        combined = unpermute(expert_out, weights, token_index, all_tokens.shape[0]).to(tokens.dtype)
        return reduce_scatter_to_sequence_parallel_region(combined, self.ep_group)


class AlltoAllTokenDispatcher:
    """See the module docstring (``alltoall``); communicates over ``ep_group``."""

    def __init__(self, ep_group) -> None:
        self.ep_group = ep_group

    def __call__(
        self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: LocalExperts
    ) -> torch.Tensor:
        ep, local_count = group_size(self.ep_group), experts.count
        permuted, token_index, expert_index = permute(tokens, routing_map)
        counts = routing_map.sum(0)  # [E] pairs of this rank per global expert
        if ep == 1:
            expert_out = experts(permuted, counts.tolist())
        else:
            all_counts = all_gather_first_dim(counts.to(torch.int64), self.ep_group)[0].view(ep, -1).tolist()  # [EP][E]
            me = group_rank(self.ep_group)
            input_splits = [sum(all_counts[me][r * local_count : (r + 1) * local_count]) for r in range(ep)]
            received_counts = [row[me * local_count : (me + 1) * local_count] for row in all_counts]  # [EP][L]
            output_splits = [sum(row) for row in received_counts]
            received = all_to_all_expert_parallel(permuted, output_splits, input_splits, self.ep_group)
            order, per_expert = _group_by_local_expert(received_counts, received.device)
            grouped_out = experts(received.index_select(0, order), per_expert)
            back = grouped_out.index_select(0, torch.argsort(order))  # source-rank order again
            expert_out = all_to_all_expert_parallel(back, input_splits, output_splits, self.ep_group)
        weights = probs[token_index, expert_index]
        return unpermute(expert_out, weights, token_index, tokens.shape[0]).to(tokens.dtype)


def _group_by_local_expert(received_counts: List[List[int]], device) -> Tuple[torch.Tensor, List[int]]:
    """Rows arrive grouped by (source rank, local expert); return the row order grouping them by
    (local expert, source rank), and the tokens per local expert."""
    ranks, local = len(received_counts), len(received_counts[0])
    starts, position = [], 0
    for r in range(ranks):
        row = []
        for j in range(local):
            row.append(position)
            position += received_counts[r][j]
        starts.append(row)
    pieces = [
        torch.arange(starts[r][j], starts[r][j] + received_counts[r][j], device=device)
        for j in range(local)
        for r in range(ranks)
    ]
    order = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)
    return order, [sum(received_counts[r][j] for r in range(ranks)) for j in range(local)]


def build_token_dispatcher(kind: str, ep_group):
    """``--moe-token-dispatcher-type``: ``allgather`` or ``alltoall``, over ``ep_group``.  ``flex``
    (Megatron's DeepEP / HybridEP fused all-to-all, CUDA only) is the alltoall dispatcher: the same
    token-to-expert exchange, by two torch.distributed all-to-alls instead of fused kernels."""
    if kind == "allgather":
        return AllGatherTokenDispatcher(ep_group)
    if kind in ("alltoall", "flex"):
        return AlltoAllTokenDispatcher(ep_group)
    raise ConfigError(f"unknown --moe-token-dispatcher-type {kind!r}; expected allgather, alltoall or flex")
