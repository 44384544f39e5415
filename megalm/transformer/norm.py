"""LayerNorm and RMSNorm over the hidden dimension, built from ``--normalization``.

Norms are replicated over TP ranks.  Under sequence parallelism each rank normalizes only
its slice of the sequence, so its weight/bias gradients are partial: the parameters carry
``sequence_parallel = True`` and are summed by
:func:`megalm.tensor_parallel.grads.allreduce_sequence_parallel_grads`.
Statistics are computed in fp32 for any parameter dtype; the output has the input's dtype.

``impl`` picks the kernel (see :mod:`megalm.fusions.backends`): ``"eager"`` (PyTorch's
``F.layer_norm`` / ``F.rms_norm``, with explicit casts for bf16/fp16 input), ``"compiled"``
(the same function through ``torch.compile``: one pass, casts in registers) or ``"apex"``
(NVIDIA apex's fused CUDA norms).
"""

from __future__ import annotations

import torch
from torch import nn

from megalm.device import get_device
from megalm.fusions import backends
from megalm.fusions.norms import layer_norm, rms_norm
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.param_info import set_param_info
from megalm.tensor_parallel.utils import set_tensor_model_parallel_attributes


def mark_norm_parameter(param: torch.Tensor, kind: str, sequence_parallel: bool) -> torch.Tensor:
    """A norm's weight or bias: replicated over TP, init ``kind`` ("ones"/"zeros"), and with
    ``sequence_parallel`` its (partial) gradient summed over the TP group."""
    set_tensor_model_parallel_attributes(param, False, -1)
    mark_init(param, kind)
    set_param_info(param, sequence_parallel=bool(sequence_parallel))
    return param


def _norm_parameter(size: int, kind: str, sequence_parallel: bool) -> nn.Parameter:
    return mark_norm_parameter(
        nn.Parameter(torch.empty(size, dtype=torch.float32, device=get_device())), kind, sequence_parallel
    )


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False, impl: str = "eager"):
        super().__init__()
        self.hidden_size, self.eps, self.impl = hidden_size, eps, impl
        self.weight = _norm_parameter(hidden_size, "ones", sequence_parallel)
        self.bias = _norm_parameter(hidden_size, "zeros", sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "apex":
            return backends.apex_norm_functions()[0](x, self.weight, self.bias, (self.hidden_size,), self.eps)
        fn = layer_norm if self.impl == "compiled" else layer_norm.eager
        return fn(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, impl={self.impl}"


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False, impl: str = "eager"):
        super().__init__()
        self.hidden_size, self.eps, self.impl = hidden_size, eps, impl
        self.weight = _norm_parameter(hidden_size, "ones", sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "apex":
            return backends.apex_norm_functions()[1](x, self.weight, (self.hidden_size,), self.eps)
        fn = rms_norm if self.impl == "compiled" else rms_norm.eager
        return fn(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, impl={self.impl}"


def build_norm(
    normalization: str, hidden_size: int, eps: float, sequence_parallel: bool = False, impl: str = "eager"
) -> nn.Module:
    """The norm named by ``--normalization`` (``LayerNorm`` or ``RMSNorm``) with kernel ``impl``."""
    if normalization == "LayerNorm":
        return LayerNorm(hidden_size, eps, sequence_parallel, impl)
    if normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps, sequence_parallel, impl)
    raise ValueError(f"unknown --normalization {normalization!r}; expected LayerNorm or RMSNorm")
