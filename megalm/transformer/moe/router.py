"""Top-k router: which experts each token goes to, with what weight, and the auxiliary losses.

For the ``T = s * b`` tokens of this rank (``[s, b, h]`` flattened, token ``t = s_index * b +
b_index``; under sequence parallelism ``s`` is this TP rank's slice):

    logits = x W_r^T                                   [T, E]  (in --moe-router-dtype when given)
    softmax:           top-k of the logits, softmax over the k chosen logits
    softmax + --moe-router-pre-softmax: softmax over all E logits, top-k of the probabilities
    sigmoid:           sigmoid of the logits, top-k, normalized to sum 1 when k > 1

The result is ``probs`` ``[T, E]`` (0 outside each token's top-k) and ``routing_map``
``[T, E]`` (bool), then capacity dropping (:mod:`~megalm.transformer.moe.capacity`).

In training the router also computes the load-balancing loss and the z-loss
(:mod:`~megalm.transformer.moe.aux_losses`), attaches them to the backward pass (z-loss on the
logits, load balancing on the probabilities) and records them and the tokens per expert for
logging, all in the model's :class:`~megalm.transformer.moe.state.MoEState` (``moe_state``).

The router weight ``[E, h]`` is replicated over TP ranks.  Communication: with TP > 1 (always
with sequence parallelism) one all-reduce over ``tp_group`` of ``2 b E + 1`` floats per forward
in training (per-sequence top-k counts, score sums and the z-loss sum of each rank's slice of
the sequence) — nothing in evaluation.  Backward: none here; the router weight carries
``sequence_parallel`` so its partial gradients are summed over TP with the norms'.

Under context parallelism (``cp_group`` of ``CP > 1`` ranks) the sequence is split over TP x CP:
the statistics are summed over ``tp_cp_group`` instead (the same one all-reduce), and the
attached partial losses are multiplied by ``CP``, as the language-model loss is
(:mod:`megalm.context_parallel.loss`), since gradients are averaged over the dp x cp ranks.  With
``--moe-expert-capacity-factor`` under CP the keep decisions are those of the whole sequence (CP 1's):
the detached ``[T, E]`` probabilities and routing map are all-gathered over ``cp_group`` (forward only,
``2 E`` floats per token), put in sequence order, dropped as one process would (capacity of ``CP T``
tokens) and this rank's rows kept (no sequence parallelism or padding to capacity: refused).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megalm.config.sections import ConfigError
from megalm.context_parallel.chunks import gathered_to_global, split_sequence
from megalm.device import get_device
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.mappings import all_gather_first_dim
from megalm.tensor_parallel.param_info import set_param_info
from megalm.tensor_parallel.utils import set_tensor_model_parallel_attributes
from megalm.transformer.moe.aux_losses import attach_aux_loss, sequence_load_balancing_loss, switch_load_balancing_loss
from megalm.transformer.moe.capacity import apply_capacity, expert_capacity
from megalm.transformer.moe.state import MoEState
from megalm.transformer.utils import init_std

_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int):
    """Top-k restricted to ``group_topk`` of ``num_groups`` expert groups (DeepSeek-V3's device-limited
    routing, Megatron's ``--moe-router-num-groups`` / ``--moe-router-group-topk``): a group's score is the
    sum of its ``topk // group_topk`` best scores; experts outside the chosen groups are masked to -inf.
    Returns ``(values, indices)`` as ``torch.topk``."""
    tokens, experts = scores.shape
    grouped = scores.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(tokens, experts)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=topk, dim=-1)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(probs, routing_map)``, both ``[T, E]``: the top-k weights (0 elsewhere) and where they are.

    ``num_groups`` / ``group_topk``: choose among the experts of the best groups only (see
    :func:`group_limited_topk`).  ``expert_bias`` ``[E]`` (sigmoid only): added to the scores to choose
    the experts, not to their weights (aux-loss-free balancing).  ``scaling_factor``: multiplies the
    final weights.
    """

    def choose(scores):
        if group_topk:
            return group_limited_topk(scores, topk, num_groups, group_topk)
        return torch.topk(scores, k=topk, dim=-1)

    wide = _at_least_fp32(logits.dtype)
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=wide).type_as(logits)
            probs, indices = choose(scores)
        else:
            top_logits, indices = choose(logits)
            probs = torch.softmax(top_logits, dim=-1, dtype=wide).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.to(wide)).type_as(logits)
        if expert_bias is not None:
            indices = choose(scores + expert_bias.to(scores.dtype))[1]
            probs = torch.gather(scores, 1, indices)
        else:
            probs, indices = choose(scores)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ConfigError(f"unknown --moe-router-score-function {score_function!r}")
    if scaling_factor:
        probs = probs * scaling_factor
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return torch.zeros_like(logits).scatter(1, indices, probs), routing_map


def scores_for_aux_loss(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """Scores over all experts (fp32 or wider) entering the load-balancing loss: softmax, or
    sigmoid normalized to sum 1."""
    wide = _at_least_fp32(logits.dtype)
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=wide)
    scores = torch.sigmoid(logits.to(wide))
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def random_logits(logits: torch.Tensor) -> torch.Tensor:
    """``--moe-router-force-load-balancing`` (Megatron's ``RandomSTE``): standard normal logits in the
    forward, the router's gradient passed straight through in the backward.  Drawn from torch's default
    generator, whose state activation recomputation restores, so a recomputed forward routes alike."""
    noise = torch.randn(logits.shape, dtype=torch.float32, device=logits.device).to(logits.dtype)
    return logits + (noise - logits).detach()


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a recomputation under activation checkpointing)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class TopKRouter(nn.Module):
    """``forward(hidden [s, b, h]) -> (probs [T, E], routing_map [T, E])``; see the module docstring.

    ``moe_state``: the model's shared :class:`MoEState` (a new one when not given).
    """

    def __init__(
        self,
        model_cfg,
        layer_number: int,
        sequence_parallel: bool = False,
        *,
        tp_group,
        moe_state: Optional[MoEState] = None,
        cp_group=None,
        tp_cp_group=None,
    ):
        super().__init__()
        m = model_cfg
        self.moe_state = MoEState() if moe_state is None else moe_state
        self.layer_number = layer_number
        self.cp_group, self.cp_size = cp_group, group_size(cp_group)
        self.num_experts, self.topk = m.num_experts, m.moe_router_topk
        self.score_function, self.pre_softmax = m.moe_router_score_function, m.moe_router_pre_softmax
        self.load_balancing_type = m.moe_router_load_balancing_type
        self.aux_loss_coeff, self.z_loss_coeff = m.moe_aux_loss_coeff, m.moe_z_loss_coeff
        self.router_dtype = _ROUTER_DTYPES[m.moe_router_dtype]
        self.capacity_factor = m.moe_expert_capacity_factor
        self.drop_policy, self.pad_to_capacity = m.moe_token_drop_policy, m.moe_pad_expert_input_to_capacity
        self.per_layer_logging = m.moe_per_layer_logging
        self.tp_group = tp_group
        self.tp_size = group_size(self.tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        # The group the tokens of a sequence are split over, and its size.
        self.split_group = tp_cp_group if self.cp_size > 1 else self.tp_group
        self.split_size = self.tp_size * self.cp_size
        self.weight = nn.Parameter(torch.empty(m.num_experts, m.hidden_size, dtype=torch.float32, device=get_device()))
        set_tensor_model_parallel_attributes(self.weight, False, -1)
        mark_init(self.weight, "normal", init_std(m))
        set_param_info(self.weight, sequence_parallel=self.sequence_parallel)
        self.num_groups, self.group_topk = m.moe_router_num_groups, m.moe_router_group_topk
        self.force_load_balancing = m.moe_router_force_load_balancing
        self.scaling_factor = m.moe_router_topk_scaling_factor
        self.bias_update_rate = m.moe_router_bias_update_rate
        if m.moe_router_enable_expert_bias:
            # Saved in checkpoints (replicated); the token counts since the last update are not.
            self.register_buffer("expert_bias", torch.zeros(m.num_experts, dtype=torch.float32, device=get_device()))
            self.register_buffer(
                "local_tokens_per_expert",
                torch.zeros(m.num_experts, dtype=torch.float32, device=get_device()),
                persistent=False,
            )
        else:
            self.expert_bias = None

    def gating(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits ``[T, E]``, computed in ``--moe-router-dtype`` when given."""
        if self.router_dtype is not None:
            return F.linear(x.to(self.router_dtype), self.weight.to(self.router_dtype))
        return F.linear(x, self.weight)

    def _split_sum(self, *tensors: torch.Tensor):
        """Sum detached statistics over the TP (x CP) group (one all-reduce); the identity at TP x CP 1."""
        if self.split_size == 1:
            return tensors
        flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=self.split_group)
        return tuple(chunk.view_as(t) for chunk, t in zip(torch.split(flat, [t.numel() for t in tensors]), tensors))

    def forward(self, hidden: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        s, b, h = hidden.shape
        logits = self.gating(hidden.reshape(s * b, h))
        if self.force_load_balancing:
            logits = random_logits(logits)
        if not self.training:
            return self._capacity(*self._route(logits), b)
        graph = torch.is_grad_enabled()
        record = not _in_backward()
        lse_sq = None
        if self.z_loss_coeff is not None:
            lse_sq = torch.logsumexp(logits.to(_at_least_fp32(logits.dtype)), dim=-1).square()  # [T]
            if graph and self.z_loss_coeff > 0:
                # Each TP rank's mean over its slice / tp: the TP ranks' partial losses add up
                # to the z-loss of the whole sequence.
                z_partial = lse_sq.mean() * (self.z_loss_coeff * self.cp_size / self.split_size)
                logits = attach_aux_loss(logits, z_partial, self.moe_state)
        probs, routing_map = self._route(logits)
        probs = self._load_balancing(logits, probs, routing_map, lse_sq, s, b, graph, record)
        probs, routing_map = self._capacity(probs, routing_map, b)
        if self.expert_bias is not None and record:
            self.local_tokens_per_expert += routing_map.sum(0).float()
        return probs, routing_map

    def _route(self, logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return topk_routing(
            logits,
            self.topk,
            self.score_function,
            self.pre_softmax,
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=self.scaling_factor,
            expert_bias=self.expert_bias,
        )

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free balancing (arXiv 2408.15664): ``bias += rate * sign(mean(n) - n)`` for the token
        counts ``n`` of the step summed over every rank that routes (TP x DP x CP); counts restart."""
        offset = tokens_per_expert.mean() - tokens_per_expert
        self.expert_bias += torch.sign(offset) * self.bias_update_rate
        self.local_tokens_per_expert.zero_()

    def _load_balancing(
        self, logits, probs, routing_map, lse_sq: Optional[torch.Tensor], s: int, b: int, graph: bool, record: bool
    ) -> torch.Tensor:
        """Statistics over the whole sequence (TP-summed), the load-balancing loss attached to
        ``probs``, and the tracker records."""
        e = self.num_experts
        scores = scores_for_aux_loss(logits, self.score_function)  # [T, E] fp32
        counts_local = routing_map.view(s, b, e).sum(0).float()  # [b, E]
        probs_sum_local = scores.view(s, b, e).sum(0)  # [b, E], part of the graph
        z_local = lse_sq.sum().reshape(1) if lse_sq is not None else torch.zeros(1, device=logits.device)
        counts, probs_sum, z_sum = (t.detach() for t in self._split_sum(counts_local, probs_sum_local, z_local))
        seq_full = s * self.split_size
        lb_partial = lb_full = None
        if self.load_balancing_type == "aux_loss":
            lb_partial = switch_load_balancing_loss(probs_sum_local.sum(0), counts.sum(0), seq_full * b, self.topk)
            lb_full = switch_load_balancing_loss(probs_sum.sum(0), counts.sum(0), seq_full * b, self.topk)
        elif self.load_balancing_type == "seq_aux_loss":
            lb_partial = sequence_load_balancing_loss(probs_sum_local, counts, seq_full, self.topk)
            lb_full = sequence_load_balancing_loss(probs_sum, counts, seq_full, self.topk)
        if lb_partial is not None and graph and self.aux_loss_coeff > 0:
            probs = attach_aux_loss(probs, lb_partial * (self.aux_loss_coeff * self.cp_size), self.moe_state)
        if record:
            tracker, layer, per_layer = self.moe_state.metrics, self.layer_number, self.per_layer_logging
            tracker.record(layer, "tokens_per_expert", counts.sum(0), per_layer)
            if lb_full is not None:
                tracker.record(layer, "load_balancing_loss", lb_full, per_layer)
            if lse_sq is not None:
                tracker.record(layer, "z_loss", z_sum[0] / (seq_full * b), per_layer)
        return probs

    def _capacity(self, probs: torch.Tensor, routing_map: torch.Tensor, b: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.capacity_factor is None:
            return probs, routing_map
        if self.cp_size > 1:
            return self._capacity_over_cp(probs, routing_map, b)
        capacity = expert_capacity(routing_map.shape[0], self.num_experts, self.topk, self.capacity_factor)
        return apply_capacity(probs, routing_map, capacity, self.drop_policy, self.pad_to_capacity)

    @torch.no_grad()
    def _keep_over_cp(self, probs: torch.Tensor, routing_map: torch.Tensor, b: int) -> torch.Tensor:
        """This rank's rows of the whole sequence's kept ``(token, expert)`` map (one all-gather over cp)."""
        e, cp = self.num_experts, self.cp_size
        local = torch.cat([probs.float(), routing_map.float()], dim=-1).view(-1, b, 2 * e)  # [s/cp, b, 2E]
        full = gathered_to_global(all_gather_first_dim(local, self.cp_group)[0], cp).view(-1, 2 * e)
        capacity = expert_capacity(full.shape[0], e, self.topk, self.capacity_factor)
        _, kept = apply_capacity(full[:, :e], full[:, e:] > 0, capacity, self.drop_policy)
        return split_sequence(kept.view(-1, b, e), 0, group_rank(self.cp_group), cp).reshape(-1, e)

    def _capacity_over_cp(
        self, probs: torch.Tensor, routing_map: torch.Tensor, b: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Capacity dropping of the whole sequence of the cp group, as one process drops it."""
        kept = self._keep_over_cp(probs.detach(), routing_map, b) & routing_map
        return probs * kept.to(probs.dtype), kept

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, topk={self.topk}, score={self.score_function}, "
            f"load_balancing={self.load_balancing_type}, capacity_factor={self.capacity_factor}"
        )
