"""LayerNorm and RMSNorm over the hidden dimension, built from ``--normalization``.

Norms are replicated over TP ranks.  Under sequence parallelism each rank normalizes only
its slice of the sequence, so its weight/bias gradients are partial: the parameters carry
``sequence_parallel = True`` and are summed by
:func:`megalm.tensor_parallel.grads.allreduce_sequence_parallel_grads`.
Statistics are computed in fp32 for any parameter dtype; the output has the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megalm.device import get_device
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.utils import set_tensor_model_parallel_attributes


def _norm_parameter(size: int, kind: str, sequence_parallel: bool) -> nn.Parameter:
    param = nn.Parameter(torch.empty(size, dtype=torch.float32, device=get_device()))
    set_tensor_model_parallel_attributes(param, False, -1)
    mark_init(param, kind)
    param.sequence_parallel = bool(sequence_parallel)
    return param


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = _norm_parameter(hidden_size, "ones", sequence_parallel)
        self.bias = _norm_parameter(hidden_size, "zeros", sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
        out = F.layer_norm(x.float(), (self.hidden_size,), self.weight.float(), self.bias.float(), self.eps)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = _norm_parameter(hidden_size, "ones", sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        return F.rms_norm(x.float(), (self.hidden_size,), self.weight.float(), self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


def build_norm(normalization: str, hidden_size: int, eps: float, sequence_parallel: bool = False) -> nn.Module:
    """The norm named by ``--normalization`` (``LayerNorm`` or ``RMSNorm``)."""
    if normalization == "LayerNorm":
        return LayerNorm(hidden_size, eps, sequence_parallel)
    if normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps, sequence_parallel)
    raise ValueError(f"unknown --normalization {normalization!r}; expected LayerNorm or RMSNorm")
