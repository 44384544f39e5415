"""Which implementation each fused piece of the model uses: chosen once, from the model config
and what is installed, and logged at start.

Order of preference per piece:

* attention core: flash-attn (``flash_attn_func``, CUDA, bf16/fp16) when installed and
  ``--attention-backend auto|flash``; megalm's blocked causal attention
  (:mod:`megalm.transformer.blocked_attention`) for ``blocked``, and for ``auto`` on a CPU in
  fp32 without attention dropout at sequence lengths where it was measured faster than SDPA;
  else PyTorch SDPA (``auto|fused``, flash / memory-efficient kernels on CUDA, the flash CPU
  kernel here); ``unfused|local`` is ``QK^T``, the scaled causal softmax (compiled when
  ``--masked-softmax-fusion`` is on) and ``@V``;
* norms: NVIDIA apex's fused LayerNorm/RMSNorm when importable on CUDA, else compiled;
* elementwise fusions (bias + GeLU/SwiGLU, RoPE, bias + dropout + add):
  ``torch.compile`` (inductor) when its flag is on, else eager;
* output layer + cross entropy: one chunked function
  (:mod:`megalm.tensor_parallel.linear_cross_entropy`) with ``--cross-entropy-loss-fusion``
  (the default), else the logits and then the vocabulary-parallel loss.
* transformer layers (``--transformer-impl``): megalm's own (``local``), or Transformer Engine's
  ``LayerNormLinear`` / ``Linear`` / ``DotProductAttention`` (``te``, see
  :mod:`megalm.transformer.te_layers`; MoE experts stay local), with fp8 delayed scaling when
  ``--fp8-format`` is given (:mod:`megalm.transformer.fp8`).  Under TE the attention core is
  TE's ``DotProductAttention`` for ``--attention-backend auto`` (TE picks flash / cuDNN /
  unfused itself) and megalm's core for the other values.

Transformer Engine, apex and flash-attn are optional GPU packages, imported lazily; asking
for one that is missing raises :class:`BackendUnavailable` saying how to install it.
``TORCHDYNAMO_DISABLE=1`` in the environment turns every compiled fusion into its eager
reference (torch's own switch).
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Optional

from megalm.device import use_cuda
from megalm.errors import MegalmError

TE_INSTALL = (
    "NVIDIA Transformer Engine is needed: on a machine with CUDA, "
    "`pip install --no-build-isolation 'transformer_engine[pytorch]'` "
    "(https://github.com/NVIDIA/TransformerEngine)"
)
APEX_INSTALL = (
    "NVIDIA apex is built from source on a machine with CUDA: `git clone https://github.com/NVIDIA/apex "
    "&& cd apex && pip install -v --no-build-isolation --config-settings '--build-option=--cpp_ext' "
    "--config-settings '--build-option=--cuda_ext' ./` (the PyPI package named 'apex' is an unrelated "
    "project: do not install it)"
)
FLASH_ATTN_INSTALL = (
    "flash-attn is needed: on a machine with CUDA, `pip install flash-attn --no-build-isolation` "
    "(https://github.com/Dao-AILab/flash-attention)"
)


class BackendUnavailable(MegalmError, RuntimeError):
    """A flag asked for an optional accelerator package that cannot be used here."""


def _import(module: str, attribute: Optional[str] = None):
    """``module.attribute`` (the module itself without ``attribute``), or None when the module (or
    its compiled extension) cannot be imported."""
    try:
        imported = importlib.import_module(module)
        return imported if attribute is None else getattr(imported, attribute, None)
    except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA extension raising anything
        return None


@functools.lru_cache(maxsize=None)
def transformer_engine_module():
    """``transformer_engine.pytorch`` on a CUDA machine, else None."""
    return _import("transformer_engine.pytorch") if use_cuda() else None


@functools.lru_cache(maxsize=None)
def apex_norm_functions():
    """``(fused_layer_norm_affine, fused_rms_norm_affine)`` from NVIDIA apex on CUDA, else None.
    (The unrelated PyPI ``apex`` has no ``apex.normalization`` and counts as absent.)"""
    if not use_cuda():
        return None
    layer = _import("apex.normalization.fused_layer_norm", "fused_layer_norm_affine")
    rms = _import("apex.normalization.fused_layer_norm", "fused_rms_norm_affine")
    return (layer, rms) if layer is not None and rms is not None else None


@functools.lru_cache(maxsize=None)
def flash_attn_function():
    """``flash_attn.flash_attn_func`` on CUDA, else None."""
    return _import("flash_attn", "flash_attn_func") if use_cuda() else None


@functools.lru_cache(maxsize=None)
def flash_attn_varlen_function():
    """``flash_attn.flash_attn_varlen_func`` on CUDA (packed sequences, ``--qkv-format thd``), else None."""
    return _import("flash_attn", "flash_attn_varlen_func") if use_cuda() else None


def compile_available() -> bool:
    """False when torch's dynamo is switched off (``TORCHDYNAMO_DISABLE=1``)."""
    return os.environ.get("TORCHDYNAMO_DISABLE", "0") != "1"


@dataclass(frozen=True)
class FusionPlan:
    """What runs where; every field is a short name used in the start-up log."""

    attention: str  # "flash-attn" | "sdpa" | "blocked" | "unfused" | "te" (TE's DotProductAttention)
    masked_softmax: str  # "compiled" | "eager" (only used by unfused attention)
    norm: str  # "apex" | "compiled" | "eager"
    bias_activation: str  # "compiled" | "eager"
    rope: str  # "compiled" | "eager" | "none"
    bias_dropout_add: str  # "compiled" | "eager"
    cross_entropy: str  # "fused linear" (output layer + loss in chunks) | "unfused"
    transformer: str = "local"  # "local" | "te" | "te, MoE experts local" (--transformer-impl)
    fp8: Optional[str] = None  # fp8 recipe with TE, e.g. "hybrid, delayed scaling (margin 0, ...)"

    def compiled(self, piece: str) -> bool:
        value = getattr(self, piece)
        return isinstance(value, str) and value.endswith("compiled")

    def uses_te(self) -> bool:
        """The transformer layers are Transformer Engine's (``--transformer-impl transformer_engine``)."""
        return self.transformer.startswith("te")

    def describe(self) -> str:
        return " | ".join(
            f"{name.replace('_', ' ')}: {value}" for name, value in vars(self).items() if value is not None
        )


def _attention(m, half_precision: bool) -> str:
    backend = m.attention_backend
    if backend == "flash" or (backend == "auto" and flash_attn_function() is not None and half_precision):
        if flash_attn_function() is None:
            raise BackendUnavailable(
                f"--attention-backend flash uses flash-attn, which is not available "
                f"{'here' if use_cuda() else 'without a GPU'}: {FLASH_ATTN_INSTALL}; "
                f"or use --attention-backend auto"
            )
        if not half_precision:
            raise BackendUnavailable("--attention-backend flash needs --bf16 or --fp16 (flash-attn has no fp32 kernel)")
        return "flash-attn"
    if uses_blocked_attention(m, half_precision, use_cuda()):
        return "blocked"
    return "unfused" if backend in ("unfused", "local") else "sdpa"


# Sequence lengths at which the blocked attention ran faster than SDPA's flash CPU kernel (fp32,
# 2 threads; 0.76x of its time at 128, 0.72x at 256, 0.60x at 512, 0.78x at 1024; slower at 100
# with head dim 32).  It keeps the probabilities (~s^2/2 per head), so long sequences stay on SDPA.
BLOCKED_ATTENTION_SEQ_RANGE = (128, 1024)


def uses_blocked_attention(m, half_precision: bool, cuda: bool) -> bool:
    """The attention core is the blocked one: ``--attention-backend blocked``, or ``auto`` with megalm's
    layers on a CPU, in fp32, without attention dropout, at a sequence length within
    :data:`BLOCKED_ATTENTION_SEQ_RANGE`.  (The plan and the memory estimate both ask here.)"""
    if m.attention_backend == "blocked":
        return True
    low, high = BLOCKED_ATTENTION_SEQ_RANGE
    return (
        m.attention_backend == "auto"
        and m.transformer_impl == "local"
        and not cuda
        and not half_precision
        and m.attention_dropout == 0
        and low <= m.seq_length <= high
    )


def _fp8_unsupported_reason() -> Optional[str]:
    """Why this GPU cannot run TE's fp8 (TE's own check, when this TE version has it), else None."""
    check = (
        _import("transformer_engine.pytorch.fp8", "check_fp8_support")  # TE 1.x
        or _import("transformer_engine.pytorch.quantization", "check_fp8_support")
    )  # TE 2.x
    if check is None:
        return None  # unknown here: TE's fp8_autocast raises at the first forward if it cannot
    available, reason = check()
    return None if available else (reason or "not supported on this GPU")


def describe_fp8(m) -> str:
    """The fp8 recipe of ``--fp8-*`` in words (start-up log)."""
    return (
        f"{m.fp8_format}, delayed scaling (margin {m.fp8_margin}, amax history {m.fp8_amax_history_len}, "
        f"{m.fp8_amax_compute_algo})"
    )


def _transformer_engine(m) -> str:
    """Check ``--transformer-impl transformer_engine`` / ``--fp8-format``; the plan's ``transformer`` field."""
    if m.transformer_impl != "transformer_engine":
        if m.fp8_format is not None:
            raise BackendUnavailable(
                f"--fp8-format {m.fp8_format} needs --transformer-impl transformer_engine "
                f"(fp8 runs inside Transformer Engine's layers, on a GPU)"
            )
        return "local"
    if transformer_engine_module() is None:
        raise BackendUnavailable(
            f"--transformer-impl transformer_engine: Transformer Engine is not available "
            f"{'here' if use_cuda() else 'without a GPU'}. {TE_INSTALL}; "
            f"or use --transformer-impl local"
        )
    if m.fp8_format is not None:
        reason = _fp8_unsupported_reason()
        if reason is not None:
            raise BackendUnavailable(
                f"--fp8-format {m.fp8_format}: Transformer Engine cannot run fp8 here: {reason}; "
                f"drop --fp8-format to train the TE layers in bf16"
            )
    return "te, MoE experts local" if m.num_experts else "te"


def plan_fusions(m, half_precision: bool = False) -> FusionPlan:
    """The plan for model config ``m`` (:class:`megalm.config.ModelConfig`); ``half_precision``:
    the model computes in bf16/fp16.  Raises :class:`BackendUnavailable` for a missing package."""
    transformer = _transformer_engine(m)
    can_compile = compile_available()

    def compiled_if(flag: bool) -> str:
        return "compiled" if flag and can_compile else "eager"

    bias_activation = m.bias_swiglu_fusion if m.swiglu else m.bias_gelu_fusion
    te_attention = transformer != "local" and m.attention_backend == "auto"
    return FusionPlan(
        attention="te" if te_attention else _attention(m, half_precision),
        masked_softmax=compiled_if(m.masked_softmax_fusion),
        norm="apex" if apex_norm_functions() is not None else compiled_if(m.norm_fusion),
        bias_activation=compiled_if(bias_activation),
        rope=compiled_if(m.apply_rope_fusion) if m.position_embedding_type == "rope" else "none",
        bias_dropout_add=compiled_if(m.bias_dropout_fusion),
        cross_entropy="fused linear" if m.cross_entropy_loss_fusion else "unfused",
        transformer=transformer,
        fp8=describe_fp8(m) if transformer != "local" and m.fp8_format is not None else None,
    )


# Every piece in plain eager PyTorch (SDPA attention): the reference the fusions are tested
# against, and the default of modules built on their own.
EAGER = FusionPlan(
    attention="sdpa",
    masked_softmax="eager",
    norm="eager",
    bias_activation="eager",
    rope="eager",
    bias_dropout_add="eager",
    cross_entropy="unfused",
)
