"""The mixture-of-experts block that replaces the dense MLP of MoE layers.

    probs, routing_map = router(x)                       # top-k of E experts per token
    y = dispatcher(x, probs, routing_map, local experts) # routed experts, weighted by probs
    y = y + shared_experts(x)                            # with --moe-shared-expert-intermediate-size
                                                         # (times sigmoid(x . g): --moe-shared-expert-gate)

Input and output ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism, which MoE requires
when TP > 1).  Parameter names (Megatron's): ``mlp.router.weight``,
``mlp.experts.local_experts.<global expert>.linear_fc{1,2}.{weight,bias}``,
``mlp.shared_experts.linear_fc{1,2}...``.

Parallelism and communication, per MoE layer and micro-batch:

* Tensor parallel, experts whole (``--expert-tensor-parallel-size 1``, megalm's default): experts
  are *not* split over TP.  Each TP rank routes and dispatches only the tokens of its own
  sequence slice, so the expert MLPs do no TP communication at all.  The cost is memory: each
  TP rank holds its ``E / EP`` experts whole.  Router and expert gradients are partial per TP
  rank and are summed over TP after the backward pass (``sequence_parallel`` attribute, one
  coalesced all-reduce with the norms); the router's statistics for the auxiliary losses take
  one small all-reduce over TP (see the router).
* Expert tensor parallel (``--expert-tensor-parallel-size`` ETP > 1, Megatron's split, any TP):
  every expert is split over the ``etp_group`` (fc1 column-, fc2 row-parallel, see
  :mod:`~megalm.transformer.moe.experts`).  Each rank routes its own tokens ``[T, h]`` as above;
  then, forward, one all-gather over ETP of the tokens ``[ETP*T, h]`` and one of the
  probabilities + routing map ``[ETP*T, 2E]`` (fp32) gives every rank of the group the same
  tokens, the dispatcher runs on them (over the EP group of ranks with the same ETP rank) and
  returns partial outputs, and a reduce-scatter over ETP sums them and keeps this rank's ``[T, h]``.
  Backward: the adjoints (all-gather of the output gradient; reduce-scatter of the token and
  probability gradients).  When ETP = TP under sequence parallelism the group's tokens are the
  replica's whole sequence (Megatron's all-gather of the sequence over TP).  The router and its
  statistics are those of ETP 1 (they run before the gather).
* Expert parallel: tokens travel over the EP group (ranks with the same TP rank, or ETP rank),
  by all-gather + reduce-scatter or by two all-to-alls (see the token dispatcher).
* Data parallel: expert parameters carry ``allreduce = False``; DDP reduces their gradients
  over the expert-data-parallel group (the ranks holding the same experts), dense ones
  (router, shared experts) over the whole data-parallel group.
* Shared experts are a dense tensor-parallel MLP: the communication of
  :class:`~megalm.transformer.mlp.MLP` (all-gather / reduce-scatter of the sequence under SP).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megalm.config.sections import ConfigError
from megalm.device import get_device
from megalm.fusions.backends import EAGER, FusionPlan
from megalm.parallel_state import group_rank, group_size
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megalm.tensor_parallel.param_info import set_param_info
from megalm.tensor_parallel.random import checkpoint
from megalm.transformer.mlp import MLP
from megalm.transformer.moe.experts import LocalExperts
from megalm.transformer.moe.router import TopKRouter
from megalm.transformer.moe.state import MoEState
from megalm.transformer.moe.token_dispatcher import build_token_dispatcher
from megalm.transformer.utils import init_std


def moe_layer_pattern(model_cfg) -> List[bool]:
    """For each global layer (0-based), whether it is an MoE layer.

    ``--moe-layer-freq k`` (int): layers ``0, k, 2k, ...`` (Megatron's ``i % k == 0``);
    a list: one 0/1 entry per layer.  All False without ``--num-experts``.
    """
    m = model_cfg
    if not m.num_experts:
        return [False] * m.num_layers
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(m.num_layers)]
    if len(freq) != m.num_layers:
        raise ConfigError(f"--moe-layer-freq has {len(freq)} entries for {m.num_layers} layers")
    return [bool(v) for v in freq]


def is_moe_layer(model_cfg, layer_number: int) -> bool:
    """Whether global layer ``layer_number`` (0-based) has an MoE block instead of a dense MLP.  Numbers
    past the decoder (``--mtp-num-layers``' layers) take the last decoder layer's kind, as Megatron's MTP spec."""
    pattern = moe_layer_pattern(model_cfg)
    return pattern[min(layer_number, len(pattern) - 1)]


class MoELayer(nn.Module):
    """``tp_group``: the router's statistics and the shared experts; ``ep_group``: the token
    exchange (which experts this rank holds follows from its rank in it); ``etp_group``: the
    ranks every expert is split over (None: experts whole); ``cp_group`` / ``tp_cp_group``: the
    router's statistics under context parallelism.  ``moe_state``: the model's shared
    :class:`MoEState` (a new one when not given; :attr:`moe_state`)."""

    def __init__(
        self,
        model_cfg,
        layer_number: int,
        sequence_parallel: bool = False,
        plan: FusionPlan = EAGER,
        *,
        tp_group,
        ep_group,
        moe_state: Optional[MoEState] = None,
        cp_group=None,
        tp_cp_group=None,
        etp_group,
    ):
        super().__init__()
        m = model_cfg
        self.etp_group = etp_group
        ep = group_size(ep_group)
        if m.num_experts % ep != 0:
            raise ConfigError(f"--num-experts {m.num_experts} is not divisible by the expert-parallel size {ep}")
        local = m.num_experts // ep
        self.layer_number = layer_number
        self.moe_state = MoEState() if moe_state is None else moe_state
        self.router = TopKRouter(
            m,
            layer_number,
            sequence_parallel,
            tp_group=tp_group,
            moe_state=self.moe_state,
            cp_group=cp_group,
            tp_cp_group=tp_cp_group,
        )
        self.experts = LocalExperts(
            m,
            group_rank(ep_group) * local,
            local,
            sequence_parallel,
            grouped=m.moe_grouped_gemm,
            plan=plan,
            etp_group=self.etp_group,
        )
        self.token_dispatcher = build_token_dispatcher(m.moe_token_dispatcher_type, ep_group)
        shared = m.moe_shared_expert_intermediate_size
        self.shared_experts = (
            MLP(dataclasses.replace(m, ffn_hidden_size=shared), sequence_parallel, plan=plan, tp_group=tp_group)
            if shared
            else None
        )
        self.gated_shared_expert = bool(shared and m.moe_shared_expert_gate)
        if self.gated_shared_expert:  # Megatron's gate_weight [1, h]; partial gradients under SP
            self.shared_experts.gate_weight = nn.Parameter(
                torch.empty(1, m.hidden_size, dtype=torch.float32, device=get_device())
            )
            mark_init(self.shared_experts.gate_weight, "normal", init_std(m))
            set_param_info(self.shared_experts.gate_weight, sequence_parallel=sequence_parallel)
        recompute = set(m.recompute_modules or ()) if m.recompute_granularity == "selective" else set()
        self.recompute_shared = "shared_experts" in recompute

    def _shared(self, hidden: torch.Tensor) -> torch.Tensor:
        """``shared_experts(x)``, times ``sigmoid(x . gate_weight)`` with ``--moe-shared-expert-gate``."""
        out = self.shared_experts(hidden)
        if self.gated_shared_expert:
            out = out * torch.sigmoid(F.linear(hidden, self.shared_experts.gate_weight))
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden.shape
        probs, routing_map = self.router(hidden)
        out = self._routed_experts(hidden.reshape(s * b, h), probs, routing_map).view(s, b, h)
        if self.shared_experts is not None:
            recompute = self.recompute_shared  # the shared experts draw no random numbers: no tracker
            out = out + (checkpoint(self._shared, hidden, rng_tracker=None) if recompute else self._shared(hidden))
        return out

    def _routed_experts(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """The dispatcher's output for this rank's tokens; with ETP > 1 run on the ETP group's
        gathered tokens and the partial outputs summed over it (see the module docstring)."""
        group = self.etp_group
        if group_size(group) == 1:
            return self.token_dispatcher(tokens, probs, routing_map, self.experts)
        num_experts = routing_map.shape[1]
        routing = torch.cat([probs.float(), routing_map.float()], dim=1)
        routing = gather_from_sequence_parallel_region(routing, group)
        all_probs, all_map = routing[:, :num_experts].to(probs.dtype), routing[:, num_experts:].detach() > 0.5
        all_tokens = gather_from_sequence_parallel_region(tokens, group)
        partial = self.token_dispatcher(all_tokens, all_probs, all_map, self.experts)
        return reduce_scatter_to_sequence_parallel_region(partial, group)


def moe_states(modules) -> List[MoEState]:
    """The distinct :class:`MoEState` objects of the MoE layers inside ``modules`` (model chunks,
    wrapped or not), in order of first appearance."""
    found = {}
    for root in modules:
        for module in root.modules():
            if isinstance(module, MoELayer):
                found.setdefault(id(module.moe_state), module.moe_state)
    return list(found.values())


def share_moe_state(chunks) -> None:
    """Give every model chunk of a rank (virtual pipeline stages) one :class:`MoEState`, the first
    chunk's: the loss function, which runs on the last chunk, then reports the metrics of the
    MoE layers of every chunk, as one model would.  No communication."""
    states = moe_states(chunks)
    if len(states) < 2:
        return
    shared = states[0]
    for root in chunks:
        for module in root.modules():
            if isinstance(getattr(module, "moe_state", None), MoEState):
                module.moe_state = shared


def begin_training_step(modules, loss_scale: float, num_microbatches: int) -> None:
    """Called by the trainer before each step's forward/backward passes with its model chunks:
    every MoE state's auxiliary-loss backward factor becomes ``loss_scale / num_microbatches`` and
    unreported metrics are dropped.  Nothing happens for a dense model."""
    for state in moe_states(modules):
        state.begin_training_step(loss_scale, num_microbatches)


def pop_moe_metrics(module: nn.Module) -> Dict[str, torch.Tensor]:
    """What the MoE layers of ``module`` (one model chunk, wrapped or not) recorded since the last
    call ({} for a dense model or in evaluation)."""
    out: Dict[str, torch.Tensor] = {}
    for state in moe_states([module]):
        out.update(state.pop_metrics())
    return out
