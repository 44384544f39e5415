"""Which architecture mapping applies to a megalm model config or a Hugging Face config.

A new mapping (e.g. Mixtral for MoE checkpoints) is one more :class:`Architecture` subclass
added to :data:`ARCHITECTURES`; until then MoE models are refused here with a message.
"""

from __future__ import annotations

from typing import List

from megalm.conversion.base import Architecture
from megalm.conversion.errors import ConversionError
from megalm.conversion.gpt2 import GPT2
from megalm.conversion.llama import Llama

ARCHITECTURES: List[Architecture] = [Llama(), GPT2()]
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "dbrx")


def _moe_experts(m) -> int:
    return int(getattr(m, "num_experts", None) or 0)


def for_megalm(m) -> Architecture:
    """The mapping for megalm model config ``m``; the error lists why each one does not fit."""
    if _moe_experts(m):
        raise ConversionError(f"this checkpoint is a mixture-of-experts model ({_moe_experts(m)} experts): "
                              f"conversion of MoE checkpoints (to MixtralForCausalLM) is not supported yet")
    reasons = {}
    for arch in ARCHITECTURES:
        wrong = arch.megalm_mismatches(m)
        if not wrong:
            return arch
        reasons[arch.hf_class] = wrong
    detail = "; ".join(f"not {name}: {', '.join(w)}" for name, w in reasons.items())
    raise ConversionError(f"no Hugging Face architecture matches this model ({detail})")


def for_hf(hf: dict) -> Architecture:
    """The mapping for a Hugging Face ``config.json``."""
    model_type = hf.get("model_type")
    if model_type in MOE_MODEL_TYPES or hf.get("num_local_experts") or hf.get("num_experts"):
        raise ConversionError(f"config.json model_type = {model_type!r} is a mixture-of-experts model: importing "
                              f"MoE checkpoints is not supported yet")
    for arch in ARCHITECTURES:
        if model_type in arch.hf_model_types:
            return arch
    known = ", ".join(t for a in ARCHITECTURES for t in a.hf_model_types)
    raise ConversionError(f"config.json model_type = {model_type!r} is not supported (supported: {known})")
