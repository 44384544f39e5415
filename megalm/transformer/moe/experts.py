"""The experts held by this rank: ``E / EP`` MLPs, each its own parameters named by GLOBAL index.

Parameter names follow Megatron's SequentialMLP: ``mlp.experts.local_experts.<global index>.
linear_fc1.weight`` ``[f or 2f (SwiGLU: [gate; up]), h]`` and ``linear_fc2.weight`` ``[h, f]``
(plus biases without ``--disable-bias-linear``).  Because the index is global, initialization
(seeded by the global name) and checkpoints (one full tensor per expert) do not depend on the
expert-parallel size: EP rank ``r`` simply holds experts ``[r E/EP, (r+1) E/EP)``.

Expert tensor parallelism (``--expert-tensor-parallel-size`` ETP, the ``etp`` group given to
:class:`LocalExperts`):

* ETP 1 (default): experts are whole on every rank; each TP rank computes the tokens of its own
  sequence slice (see :mod:`~megalm.transformer.moe.moe_layer`), so its gradients are partial:
  the records say ``sequence_parallel`` when TP > 1 (summed over TP, as for norms).
* ETP > 1: Megatron's split.  ``linear_fc1`` is column-parallel (ETP rank ``r`` holds rows
  ``r f/ETP ...`` of ``[f, h]``; with SwiGLU ``[gate_r; up_r]``, stride 2) and ``linear_fc2``
  row-parallel (columns ``r f/ETP ...`` of ``[h, f]``), so ``fc2(act(fc1(x)))`` on one rank is its
  partial sum of the expert's output: the caller gives every rank of the ETP group the same tokens
  and sums the partial outputs over the group (:class:`~megalm.transformer.moe.moe_layer.MoELayer`).
  Every rank then computes the whole gradient of its shard: no ``sequence_parallel``.  ``linear_fc2``'s
  bias is whole on every rank of the group and enters each partial output as ``b / ETP`` (so the
  sum adds it once) with the gradient of ``b`` itself: every rank of the group computes the whole
  bias gradient (it sees all the group's tokens and the whole output gradient), so the copies stay
  equal and count once in the gradient norm (on ETP rank 0).
  The records say ``tensor_parallel`` with the split dim and stride; for an expert parameter that
  split is over the ETP group (initialization cuts the full tensor drawn from the global name's
  seed, checkpoints store the full tensor: both are ETP-independent).

Every expert parameter's record (:func:`~megalm.tensor_parallel.param_info.param_info`) says
``expert`` (gradients reduced over the expert-data-parallel group by DDP; Megatron's
``allreduce = False``).

:meth:`LocalExperts.forward` takes the tokens sorted by local expert with their counts and
computes ``fc2(act(fc1(x)))`` per expert, either

* in a loop of per-expert matmuls, or
* with ``--moe-grouped-gemm``: one ``bmm`` over the local experts' stacked weights, each
  expert's tokens padded to the largest count (padding rows are zeros and are discarded).

Both give the same values (to float rounding).  The bias of ``linear_fc1`` and the activation
are one fused call (``expert_bias_gelu`` / ``expert_bias_swiglu`` of
:mod:`megalm.fusions.activations`, compiled for changing token counts when the fusion plan
compiles the bias activation).  No communication.
"""

from __future__ import annotations

import functools
from typing import List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megalm.device import get_device
from megalm.distributed.unsharder import GATHER_UNIT
from megalm.fusions.activations import glu_activation, pointwise_fusion
from megalm.fusions.backends import EAGER, FusionPlan
from megalm.fusions.compile import select
from megalm.parallel_state import group_size
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.param_info import set_param_info
from megalm.tensor_parallel.random import checkpoint
from megalm.tensor_parallel.utils import divide, set_tensor_model_parallel_attributes
from megalm.transformer.utils import init_std, output_init_std, recompute_modules


def _expert_parameter(
    *shape: int, kind: str, std=None, sequence_parallel: bool = False, split_dim=None, stride: int = 1
) -> nn.Parameter:
    """An expert parameter of local ``shape``; ``split_dim``: the dim split over the ETP group (None: whole)."""
    param = nn.Parameter(torch.empty(*shape, dtype=torch.float32, device=get_device()))
    set_tensor_model_parallel_attributes(param, split_dim is not None, -1 if split_dim is None else split_dim, stride)
    mark_init(param, kind, std)
    set_param_info(param, expert=True, sequence_parallel=bool(sequence_parallel))
    return param


def bias_activation(m, plan: FusionPlan):
    """The experts' bias + activation; recomputed in backward with ``--recompute-modules moe_act``."""
    act = _bias_activation(m, plan)
    if "moe_act" in recompute_modules(m):
        return functools.partial(checkpoint, act, rng_tracker=None)  # no random draws
    return act


def _bias_activation(m, plan: FusionPlan):
    """``act(x + bias)`` (GELU, tanh GELU with ``--openai-gelu``, squared ReLU with ``--squared-relu``, or
    SwiGLU of a ``[gate, up]`` last dimension) for model config ``m``, compiled per the plan."""
    if m.gated_linear_unit:
        return glu_activation(m, plan.compiled("bias_activation"), expert=True)
    return select(pointwise_fusion(m, expert=True), plan.compiled("bias_activation"))


class _Linear(nn.Module):
    """``x W^T + b`` with expert parameters (so names read ``linear_fc1.weight``).

    ``split``: ``None`` (whole), ``"column"`` (out rows split over ``etp`` ranks, ``stride`` 2 for
    ``[gate; up]``) or ``"row"`` (in columns split; the bias whole, see :meth:`output_bias`).
    """

    def __init__(
        self,
        in_size: int,
        out_size: int,
        bias: bool,
        std: float,
        sequence_parallel: bool,
        split=None,
        etp: int = 1,
        stride: int = 1,
    ):
        super().__init__()
        if split == "column":
            out_size, w_dim, b_dim = divide(out_size, etp), 0, 0
        elif split == "row":
            in_size, w_dim, b_dim = divide(in_size, etp), 1, None
        else:
            w_dim = b_dim = None
        self.bias_share = etp if split == "row" else 1
        sp = sequence_parallel
        self.weight = _expert_parameter(
            out_size, in_size, kind="normal", std=std, sequence_parallel=sp, split_dim=w_dim, stride=stride
        )
        self.bias = (
            _expert_parameter(out_size, kind="zeros", sequence_parallel=sp, split_dim=b_dim, stride=stride)
            if bias
            else None
        )

    def output_bias(self):
        """The bias this rank adds: a row-parallel layer's whole bias ``b`` as ``b / ETP`` in value (the
        partial outputs of the group sum to one ``b``) with the gradient of ``b`` (each rank's is the whole)."""
        b = self.bias
        if b is None or self.bias_share == 1:
            return b
        return b.detach() / self.bias_share + (b - b.detach())

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        return F.linear(x, self.weight, self.output_bias() if add_bias else None)


class ExpertMLP(nn.Module):
    """One expert: ``linear_fc2(act(linear_fc1(x)))``, fc1's bias added inside the activation.
    ``etp``: the size of the group its weights are split over (1: whole; see the module docstring)."""

    def __init__(self, model_cfg, sequence_parallel: bool = False, plan: FusionPlan = EAGER, etp: int = 1):
        super().__init__()
        m = model_cfg
        f = m.moe_ffn_hidden_size
        split = etp > 1
        self.linear_fc1 = _Linear(
            m.hidden_size,
            2 * f if m.gated_linear_unit else f,
            m.add_bias_linear,
            init_std(m),
            sequence_parallel,
            split="column" if split else None,
            etp=etp,
            stride=2 if m.gated_linear_unit else 1,
        )
        self.linear_fc2 = _Linear(
            f, m.hidden_size, m.add_bias_linear, output_init_std(m), sequence_parallel, "row" if split else None, etp
        )
        self.bias_activation = bias_activation(m, plan)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.bias_activation(self.linear_fc1(x, add_bias=False), self.linear_fc1.bias))


class LocalExperts(nn.Module):
    """Experts ``first, ..., first + count - 1`` (global indices) of this EP rank; with an ``etp_group``
    of size > 1, this rank's shards of them (see the module docstring: the output is then partial)."""

    def __init__(
        self,
        model_cfg,
        first: int,
        count: int,
        sequence_parallel: bool = False,
        grouped: bool = False,
        plan: FusionPlan = EAGER,
        etp_group=None,
    ):
        super().__init__()
        self.first, self.count = first, count
        self.grouped = grouped
        self.etp_group = etp_group
        etp = group_size(etp_group)
        self.bias_activation = bias_activation(model_cfg, plan)
        self.local_experts = nn.ModuleDict(
            {str(first + j): ExpertMLP(model_cfg, sequence_parallel and etp == 1, plan, etp) for j in range(count)}
        )
        # ZeRO-3 gathers the local experts' weights as one unit, in this module's forward pre-hook: the grouped
        # GEMM reads them without running the experts' modules.
        setattr(self, GATHER_UNIT, True)

    def experts(self) -> List[ExpertMLP]:
        return list(self.local_experts.values())

    def forward(self, tokens: torch.Tensor, tokens_per_expert: Sequence[int]) -> torch.Tensor:
        """``tokens`` ``[N, h]`` sorted by local expert, ``tokens_per_expert`` their counts (sum N)."""
        counts = [int(c) for c in tokens_per_expert]
        if len(counts) != self.count or sum(counts) != tokens.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens do not match counts {counts} for {self.count} experts")
        if self.grouped:
            return self._grouped(tokens, counts)
        chunks = torch.split(tokens, counts, dim=0)
        return torch.cat([expert(chunk) for expert, chunk in zip(self.experts(), chunks)], dim=0)

    def _grouped(self, tokens: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """One bmm per linear layer over ``[experts, max count, h]`` zero-padded token blocks."""
        experts = self.experts()
        width = max(counts) if counts else 0
        h = tokens.shape[-1]
        expert_of = torch.repeat_interleave(
            torch.arange(self.count, device=tokens.device), torch.tensor(counts, device=tokens.device)
        )
        starts = torch.tensor([0] + counts[:-1], device=tokens.device).cumsum(0)
        slot = expert_of * width + (torch.arange(tokens.shape[0], device=tokens.device) - starts[expert_of])
        padded = tokens.new_zeros(self.count * width, h).index_copy(0, slot, tokens).view(self.count, width, h)
        fc1 = [e.linear_fc1 for e in experts]
        out = self.bias_activation(self._grouped_linear(padded, fc1, add_bias=False), self._stacked_bias(fc1))
        out = self._grouped_linear(out, [e.linear_fc2 for e in experts])
        return out.reshape(self.count * width, out.shape[-1]).index_select(0, slot)

    @staticmethod
    def _stacked_bias(layers: Sequence[_Linear]):
        """``[L, 1, out]`` biases of ``layers`` (broadcast over each expert's tokens), or None."""
        return None if layers[0].bias is None else torch.stack([layer.output_bias() for layer in layers]).unsqueeze(1)

    @classmethod
    def _grouped_linear(cls, x: torch.Tensor, layers: Sequence[_Linear], add_bias: bool = True) -> torch.Tensor:
        weight = torch.stack([layer.weight for layer in layers])  # [L, out, in]
        out = torch.bmm(x, weight.transpose(1, 2))
        bias = cls._stacked_bias(layers) if add_bias else None
        return out if bias is None else out + bias

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + self.count - 1}, grouped={self.grouped}"
