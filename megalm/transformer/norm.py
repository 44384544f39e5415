"""LayerNorm and RMSNorm over the hidden dimension, built from ``--normalization``.

Norms are replicated over TP ranks.  Under sequence parallelism each rank normalizes only
its slice of the sequence, so its weight/bias gradients are partial: the parameters carry
``sequence_parallel = True`` and are summed by
:func:`megalm.tensor_parallel.grads.allreduce_sequence_parallel_grads`.
Statistics are computed in fp32 for any parameter dtype; the output has the input's dtype.

``zero_centered_gamma`` (Megatron's ``--apply-layernorm-1p``): the weight starts at 0 and the norm
scales by ``1 + weight``: the stored weights stay near 0, where bf16 / fp16 are most precise.

``impl`` picks the kernel (see :mod:`megalm.fusions.backends`): ``"eager"`` (PyTorch's
``F.layer_norm`` / ``F.rms_norm``, with explicit casts for bf16/fp16 input), ``"compiled"``
(the same function through ``torch.compile``: one pass, casts in registers) or ``"apex"``
(NVIDIA apex's fused CUDA norms).
"""

from __future__ import annotations

import torch
from torch import nn

from megalm.config.sections import ConfigError
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


class _Norm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool, impl: str, zero_centered_gamma: bool):
        super().__init__()
        self.hidden_size, self.eps, self.impl, self.zero_centered_gamma = hidden_size, eps, impl, zero_centered_gamma
        self.weight = _norm_parameter(hidden_size, "zeros" if zero_centered_gamma else "ones", sequence_parallel)

    def scale(self) -> torch.Tensor:
        """The multiplier applied after normalizing: ``weight``, or ``1 + weight`` when zero-centered."""
        return self.weight + 1 if self.zero_centered_gamma else self.weight

    def extra_repr(self) -> str:
        centered = ", zero_centered_gamma" if self.zero_centered_gamma else ""
        return f"{self.hidden_size}, eps={self.eps}, impl={self.impl}{centered}"


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        impl: str = "eager",
        zero_centered_gamma: bool = False,
    ):
        super().__init__(hidden_size, eps, sequence_parallel, impl, zero_centered_gamma)
        self.bias = _norm_parameter(hidden_size, "zeros", sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "apex":
            return backends.apex_norm_functions()[0](x, self.scale(), self.bias, (self.hidden_size,), self.eps)
        fn = layer_norm if self.impl == "compiled" else layer_norm.eager
        return fn(x, self.scale(), self.bias, self.eps)


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        impl: str = "eager",
        zero_centered_gamma: bool = False,
    ):
        super().__init__(hidden_size, eps, sequence_parallel, impl, zero_centered_gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "apex":
            return backends.apex_norm_functions()[1](x, self.scale(), (self.hidden_size,), self.eps)
        fn = rms_norm if self.impl == "compiled" else rms_norm.eager
        return fn(x, self.scale(), self.eps)


def build_norm(
    normalization: str,
    hidden_size: int,
    eps: float,
    sequence_parallel: bool = False,
    impl: str = "eager",
    zero_centered_gamma: bool = False,
) -> nn.Module:
    """The norm named by ``--normalization`` (``LayerNorm`` or ``RMSNorm``) with kernel ``impl``."""
    if normalization == "LayerNorm":
        return LayerNorm(hidden_size, eps, sequence_parallel, impl, zero_centered_gamma)
    if normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps, sequence_parallel, impl, zero_centered_gamma)
    raise ConfigError(f"unknown --normalization {normalization!r}; expected LayerNorm or RMSNorm")
