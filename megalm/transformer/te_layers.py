"""Attention and MLP built from NVIDIA Transformer Engine modules (``--transformer-impl transformer_engine``).

The layout is Megatron-LM's TE layer spec: the layer's own norms are identities and each norm is
fused into the linear that follows it::

    self_attention.linear_qkv         te.LayerNormLinear     input norm + QKV, parallel_mode="column"
    self_attention.te_core_attention  te.DotProductAttention qkv_format "sbhd", causal, GQA via num_gqa_groups
    self_attention.linear_proj        te.Linear              attention output, parallel_mode="row"
    mlp.linear_fc1                    te.LayerNormLinear     pre-MLP norm + fc1 ([gate; up] for SwiGLU), "column"
    mlp.linear_fc2                    te.Linear              fc2, parallel_mode="row"

Everything else is megalm's: the QKV split (Megatron's grouped layout), RoPE, the bias +
activation and bias + dropout + residual fusions, the KV-cache path of generation, MoE layers.

Communication (TE's, over the tensor-parallel group):

* ``LayerNormLinear`` (column): forward normalizes this rank's input, then all-gathers the
  normalized ``[s/tp, b, h]`` along the sequence under sequence parallelism (nothing otherwise);
  backward reduce-scatters (SP) or all-reduces the gradient of the normalized input before the
  norm's backward, so norm gradients are complete without SP and partial (summed by megalm's
  sequence-parallel all-reduce) with it.
* ``Linear`` (row): forward all-reduces the partial products (reduce-scatter along the sequence
  under SP); backward all-gathers the output gradient under SP, nothing otherwise.
* ``DotProductAttention``: none (this rank's heads); dropout draws from the tracker's
  model-parallel stream as megalm's own core does.

Parameters keep megalm's contract (:mod:`megalm.tensor_parallel.utils`): TE's weights are
marked like the local layers' (``partition_stride`` 2 for SwiGLU's fused ``[gate; up]`` fc1,
whose rank ``r`` holds ``[gate_r; up_r]`` as in Megatron), norm weights are replicated and carry
``sequence_parallel``, and every parameter has an init rule; TE's own initialization is skipped
(``init_method`` is a no-op) because :func:`~megalm.tensor_parallel.initialization.initialize_weights`
fills every parameter afterwards, seeded by its canonical name (:mod:`megalm.parameter_names`).
"""

from __future__ import annotations

from typing import Optional

import torch

from megalm.config.sections import ConfigError
from megalm.device import get_device
from megalm.fusions import backends
from megalm.fusions.backends import EAGER, FusionPlan
from megalm.parallel_state import group_size
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.random import RNGStatesTracker, dropout_rng
from megalm.tensor_parallel.utils import set_tensor_model_parallel_attributes
from megalm.transformer.attention import SelfAttention
from megalm.transformer.mlp import MLP, fc1_layout
from megalm.transformer.norm import mark_norm_parameter
from megalm.transformer.utils import init_std, output_init_std


def _skip_init(weight: torch.Tensor) -> None:
    """TE's ``init_method``: nothing, megalm's layout-independent init fills the weight later (and
    TE drawing its own values would only consume random numbers)."""


def _te():
    te = backends.transformer_engine_module()
    if te is None:
        raise backends.BackendUnavailable(
            f"Transformer Engine layers need Transformer Engine on a GPU: {backends.TE_INSTALL}"
        )
    return te


def _tensor_parallel_kwargs(sequence_parallel: bool, tp_group) -> dict:
    """``tp_group`` / ``tp_size`` / ``sequence_parallel`` as TE's modules take them."""
    tp = group_size(tp_group)
    return dict(sequence_parallel=bool(sequence_parallel) and tp > 1, tp_group=tp_group, tp_size=tp)


def adopt_te_parameters(
    module: torch.nn.Module,
    parallel_mode: str,
    std: float,
    stride: int = 1,
    sequence_parallel: bool = False,
    tp_size: int = 1,
    zero_centered_gamma: bool = False,
) -> torch.nn.Module:
    """Give a TE ``Linear`` / ``LayerNormLinear``'s parameters megalm's attributes and init rules.

    ``weight``: split along dim 0 (column, with ``stride``) or 1 (row), normal(0, ``std``);
    ``bias``: split like the output (column) or replicated with ``sequence_parallel`` (row), zeros;
    ``layer_norm_weight`` / ``layer_norm_bias``: replicated with ``sequence_parallel``, ones / zeros
    (``zero_centered_gamma``: the weight starts at zeros, TE scaling by ``1 + weight``).
    """
    column = parallel_mode == "column"
    sp = bool(sequence_parallel) and tp_size > 1
    for name, param in module.named_parameters(recurse=False):
        if name == "weight":
            set_tensor_model_parallel_attributes(param, True, 0 if column else 1, stride if column else 1)
            mark_init(param, "normal", std)
        elif name == "bias" and column:
            set_tensor_model_parallel_attributes(param, True, 0, stride)
            mark_init(param, "zeros")
        elif name == "bias":
            mark_norm_parameter(param, "zeros", sp)  # added after the row reduction: partial grads under SP
        elif name in ("layer_norm_weight", "layer_norm_bias"):
            ones = name == "layer_norm_weight" and not zero_centered_gamma
            mark_norm_parameter(param, "ones" if ones else "zeros", sp)
        else:
            raise ValueError(f"unexpected Transformer Engine parameter {name!r} in {type(module).__name__}")
    return module


def norm_column_linear(
    m,
    input_size: int,
    output_size: int,
    *,
    std: float,
    return_bias: bool,
    sequence_parallel: bool,
    tp_group,
    stride: int = 1,
    qkv: bool = False,
) -> torch.nn.Module:
    """``te.LayerNormLinear``: ``--normalization`` (eps ``--norm-epsilon``) fused with a column-parallel linear
    (``qkv``: the attention's, which ``--add-qkv-bias`` gives a bias)."""
    bias = m.add_bias_linear or (qkv and m.add_qkv_bias)
    module = _te().LayerNormLinear(
        input_size,
        output_size,
        eps=m.norm_epsilon,
        bias=bias,
        normalization=m.normalization,
        zero_centered_gamma=m.apply_layernorm_1p,
        return_bias=return_bias and bias,
        parallel_mode="column",
        init_method=_skip_init,
        params_dtype=torch.float32,
        device=get_device(),
        **_tensor_parallel_kwargs(sequence_parallel, tp_group),
    )
    return adopt_te_parameters(
        module, "column", std, stride, sequence_parallel, group_size(tp_group), zero_centered_gamma=m.apply_layernorm_1p
    )


def row_linear(
    m, input_size: int, output_size: int, *, std: float, return_bias: bool, sequence_parallel: bool, tp_group
) -> torch.nn.Module:
    """``te.Linear`` in row-parallel mode (input split along its last dimension)."""
    bias = m.add_bias_linear
    module = _te().Linear(
        input_size,
        output_size,
        bias=bias,
        return_bias=return_bias and bias,
        parallel_mode="row",
        init_method=_skip_init,
        params_dtype=torch.float32,
        device=get_device(),
        **_tensor_parallel_kwargs(sequence_parallel, tp_group),
    )
    return adopt_te_parameters(module, "row", std, 1, sequence_parallel, group_size(tp_group))


def _output_and_bias(out):
    """TE returns ``(output, bias)`` only when asked for the bias (and the layer has one)."""
    return out if isinstance(out, tuple) else (out, None)


class TESelfAttention(SelfAttention):
    """:class:`~megalm.transformer.attention.SelfAttention` on TE modules.

    ``linear_qkv`` normalizes its input (the layer's ``input_layernorm`` is an identity).  The core
    is TE's ``DotProductAttention`` when the plan's attention is ``"te"`` (``--attention-backend
    auto``), else megalm's.  Generation with a KV cache uses megalm's cached attention.
    """

    def __init__(
        self,
        model_cfg,
        sequence_parallel: bool = False,
        recompute_core: bool = False,
        plan: FusionPlan = EAGER,
        skip_output_bias: bool = False,
        *,
        tp_group,
        cp_group=None,
        cp_comm_type: str = "p2p",
        layer_number: int = 0,
        rng_tracker: Optional[RNGStatesTracker] = None,
    ):
        super().__init__(
            model_cfg,
            sequence_parallel,
            recompute_core=recompute_core,
            plan=plan,
            skip_output_bias=skip_output_bias,
            tp_group=tp_group,
            cp_group=cp_group,
            cp_comm_type=cp_comm_type,
            layer_number=layer_number,
            rng_tracker=rng_tracker,
        )
        m = model_cfg
        self.te_core_attention = None
        if plan.attention == "te":
            self.te_core_attention = _te().DotProductAttention(
                m.num_attention_heads,
                m.head_dim,
                num_gqa_groups=m.num_kv_heads,
                attention_dropout=m.attention_dropout,
                qkv_format="sbhd",
                attn_mask_type="causal",
                get_rng_state_tracker=self._rng_tracker,  # TE forks the model's tracker
                **_tensor_parallel_kwargs(sequence_parallel, self.tp_group),
            )

    def build_projections(self, m, qkv_size: int, sequence_parallel: bool, skip_output_bias: bool):
        linear_qkv = norm_column_linear(
            m,
            m.hidden_size,
            qkv_size,
            std=init_std(m),
            return_bias=False,
            sequence_parallel=sequence_parallel,
            tp_group=self.tp_group,
            qkv=True,
        )
        linear_proj = row_linear(
            m,
            m.num_attention_heads * self.head_dim,
            m.hidden_size,
            std=output_init_std(m),
            return_bias=skip_output_bias,
            sequence_parallel=sequence_parallel,
            tp_group=self.tp_group,
        )
        return linear_qkv, linear_proj

    def attention_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """``[s, b, n, d]`` q/k/v -> ``[s, b, heads_r * d]`` (no ``attention_mask``: refused by validation)."""
        if attention_mask is not None:
            raise ConfigError("--reset-attention-mask is not supported with --transformer-impl transformer_engine")
        if self.te_core_attention is None:
            return super().attention_core(q, k, v)
        p = self.attention_dropout if self.training else 0.0
        with dropout_rng(self.rng_tracker, p, model_parallel_rng=True):
            return self.te_core_attention(q, k, v)

    def _rng_tracker(self) -> RNGStatesTracker:
        """TE's ``get_rng_state_tracker``: the tracker this layer was given."""
        return self.rng_tracker


class TEMLP(MLP):
    """:class:`~megalm.transformer.mlp.MLP` on TE modules: ``linear_fc1`` normalizes its input (the
    layer's ``pre_mlp_layernorm`` is an identity) and returns its bias for megalm's fused bias +
    GeLU / SwiGLU; ``linear_fc2`` returns its bias for the layer's bias + dropout + add."""

    def build_linears(self, m, sequence_parallel: bool, skip_output_bias: bool):
        fc1_size, stride = fc1_layout(m)
        linear_fc1 = norm_column_linear(
            m,
            m.hidden_size,
            fc1_size,
            std=init_std(m),
            return_bias=True,
            sequence_parallel=sequence_parallel,
            tp_group=self.tp_group,
            stride=stride,
        )
        linear_fc2 = row_linear(
            m,
            m.ffn_hidden_size,
            m.hidden_size,
            std=output_init_std(m),
            return_bias=skip_output_bias,
            sequence_parallel=sequence_parallel,
            tp_group=self.tp_group,
        )
        return linear_fc1, linear_fc2

    def forward(self, hidden: torch.Tensor):
        return self.linear_fc2(self.bias_activation(*_output_and_bias(self.linear_fc1(hidden))))
