"""Stand-in for ``transformer_engine.pytorch.Linear`` and ``LayerNormLinear``.

Same constructor arguments (the userbuffer / fp8-parameter options are left out and rejected),
parameter names (``weight``, ``bias``, ``layer_norm_weight``, ``layer_norm_bias``), local shapes,
parameter attributes and communication as TE:

* column: ``weight`` ``[out/tp, in]``; input all-gathered along dim 0 under sequence parallelism
  (backward reduce-scatter), else passed through (backward all-reduce); in ``LayerNormLinear`` the
  norm runs before the gather, on this rank's rows;
* row: ``weight`` ``[out, in/tp]``; output all-reduced, or reduce-scattered along dim 0 under
  sequence parallelism (backward all-gather); the bias is added after the reduction.

With ``return_bias`` the bias is not added but returned (an empty tensor when the layer has none,
as TE does).  Inside ``fp8_autocast`` a module records ``fp8 = True`` and the recipe in
``fp8_meta["recipe"]`` but computes in the input's precision.
"""

import io
import pickle

import torch
import torch.nn.functional as F

from . import fp8 as _fp8
from .distributed import (
    column_parallel_input,
    get_distributed_world_size,
    row_parallel_output,
    set_tensor_model_parallel_attributes,
)

_DEFAULT_INIT_STD = 0.023  # TE's default init_method: normal(0, 0.023)


def _check_unsupported(**options):
    used = {k: v for k, v in options.items() if v}
    if used:
        raise NotImplementedError(f"the Transformer Engine stand-in does not implement {sorted(used)}")


class TransformerEngineBaseModule(torch.nn.Module):
    """What the stand-in keeps of TE's base module: tensor-parallel group, fp8 bookkeeping, extra state."""

    def _init_parallel(self, tp_group, tp_size: int, sequence_parallel: bool, parallel_mode):
        assert parallel_mode in (None, "column", "row"), f"parallel_mode {parallel_mode} not supported"
        self.tp_group = tp_group
        self.tp_size = tp_size if tp_group is None else get_distributed_world_size(tp_group)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel
        self.fp8, self.fp8_meta, self.fp8_forwards = False, {"recipe": None}, 0

    def _prepare_forward(self, inp: torch.Tensor):
        if self.tp_size > 1 and self.tp_group is None:
            raise RuntimeError("tensor parallel size > 1 needs tp_group (or set_tensor_parallel_group)")
        self.fp8 = _fp8.is_fp8_enabled()
        if self.fp8:
            self.fp8_meta["recipe"] = _fp8.get_fp8_recipe()
            self.fp8_meta["fp8_group"] = _fp8.get_fp8_group()
            self.fp8_forwards += 1

    def set_tensor_parallel_group(self, tp_group) -> None:
        self.tp_group = tp_group

    # TE saves its fp8 metadata (scales, amax history) as pickled "extra state" (a BytesIO in TE 1.x).
    def get_extra_state(self):
        state = io.BytesIO()
        pickle.dump({"recipe": repr(self.fp8_meta.get("recipe")), "amax_history": torch.zeros(1, 3)}, state)
        return state

    def set_extra_state(self, state) -> None:
        pass

    def _make_linear_parameters(self, in_features, out_features, bias, init_method, params_dtype, device):
        if self.parallel_mode == "column":
            assert out_features % self.tp_size == 0, (out_features, self.tp_size)
            out_features //= self.tp_size
        elif self.parallel_mode == "row":
            assert in_features % self.tp_size == 0, (in_features, self.tp_size)
            in_features //= self.tp_size
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
        with torch.no_grad():
            (init_method or (lambda w: torch.nn.init.normal_(w, 0.0, _DEFAULT_INIT_STD)))(self.weight)
        set_tensor_model_parallel_attributes(self.weight, True, 1 if self.parallel_mode == "row" else 0, 1)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=params_dtype, device=device))
            if self.parallel_mode == "row":
                self.bias.sequence_parallel = self.sequence_parallel
            elif self.parallel_mode == "column":
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        else:
            self.bias = torch.Tensor().to(dtype=params_dtype, device=device)

    def _linear(self, x: torch.Tensor):
        """The GEMM with TE's communication and bias handling (``x`` already normalized for LayerNormLinear)."""
        dtype = x.dtype
        if self.parallel_mode == "column":
            x = column_parallel_input(x, self.tp_group, self.tp_size, self.sequence_parallel)
        apply_bias = self.use_bias and not self.return_bias
        out = F.linear(
            x, self.weight.to(dtype), self.bias.to(dtype) if apply_bias and self.parallel_mode != "row" else None
        )
        if self.parallel_mode == "row":
            out = row_parallel_output(out, self.tp_group, self.tp_size, self.sequence_parallel)
            if apply_bias:
                out = out + self.bias.to(dtype)
        if self.return_bias:
            return out, self.bias.to(dtype)
        return out


class Linear(TransformerEngineBaseModule):
    """``y = x W^T + b`` (TE's ``transformer_engine.pytorch.Linear``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name=None,
        init_method=None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype=None,
        parallel_mode=None,
        skip_weight_param_allocation: bool = False,
        parameters_split=None,
        device="cuda",
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name=None,
    ):
        super().__init__()
        _check_unsupported(
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            parameters_split=parameters_split,
            skip_weight_param_allocation=skip_weight_param_allocation,
            ub_overlap_rs=ub_overlap_rs,
            ub_overlap_ag=ub_overlap_ag,
        )
        self._init_parallel(tp_group, tp_size, sequence_parallel, parallel_mode)
        self.return_bias = return_bias
        self._make_linear_parameters(
            in_features, out_features, bias, init_method, params_dtype or torch.get_default_dtype(), device
        )

    def forward(self, inp: torch.Tensor, is_first_microbatch=None, fp8_output: bool = False):
        self._prepare_forward(inp)
        return self._linear(inp)


class LayerNormLinear(TransformerEngineBaseModule):
    """LayerNorm or RMSNorm of the input, then a linear (TE's ``transformer_engine.pytorch.LayerNormLinear``)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name=None,
        init_method=None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype=None,
        parallel_mode=None,
        return_layernorm_output: bool = False,
        return_layernorm_output_gathered: bool = False,
        parameters_split=None,
        zero_centered_gamma: bool = False,
        device="cuda",
        ub_overlap_ag: bool = False,
        ub_name=None,
    ):
        super().__init__()
        _check_unsupported(
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            parameters_split=parameters_split,
            return_layernorm_output=return_layernorm_output,
            ub_overlap_ag=ub_overlap_ag,
            return_layernorm_output_gathered=return_layernorm_output_gathered,
        )
        assert normalization in ("LayerNorm", "RMSNorm"), "Unsupported normalization type!"
        self._init_parallel(tp_group, tp_size, sequence_parallel, parallel_mode)
        self.normalization, self.eps, self.zero_centered_gamma = normalization, eps, zero_centered_gamma
        self.return_bias = return_bias
        params_dtype = params_dtype or torch.get_default_dtype()
        self.layer_norm_weight = torch.nn.Parameter(
            torch.full((in_features,), 0.0 if zero_centered_gamma else 1.0, dtype=params_dtype, device=device)
        )
        self.layer_norm_weight.sequence_parallel = self.sequence_parallel
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, dtype=params_dtype, device=device))
            self.layer_norm_bias.sequence_parallel = self.sequence_parallel
        else:
            self.layer_norm_bias = None
        self._make_linear_parameters(in_features, out_features, bias, init_method, params_dtype, device)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        """In fp32, as TE's kernels, and back to the input's dtype."""
        weight = self.layer_norm_weight.float() + (1.0 if self.zero_centered_gamma else 0.0)
        shape = (x.shape[-1],)
        if self.normalization == "LayerNorm":
            out = F.layer_norm(x.float(), shape, weight, self.layer_norm_bias.float(), self.eps)
        else:
            out = F.rms_norm(x.float(), shape, weight, self.eps)
        return out.to(x.dtype)

    def forward(self, inp: torch.Tensor, is_first_microbatch=None, fp8_output: bool = False):
        self._prepare_forward(inp)
        return self._linear(self._normalize(inp))
