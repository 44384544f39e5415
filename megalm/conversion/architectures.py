"""Which architecture mapping applies to a megalm model config or a Hugging Face config.

Dense models map to :class:`~megalm.conversion.llama.Llama` or :class:`~megalm.conversion.gpt2.GPT2`,
mixture-of-experts models (``--num-experts``) to :class:`~megalm.conversion.mixtral.Mixtral`, or with
multi-latent attention to :class:`~megalm.conversion.deepseek_v3.DeepseekV3`.
A new mapping is one more :class:`Architecture` subclass added to :data:`ARCHITECTURES`.  Other
Hugging Face MoE families (Qwen-MoE, DeepSeek-V2, OLMoE, DBRX, ...) are refused with a message:
their routers, shared experts or weight layouts differ from Mixtral's.
"""

from __future__ import annotations

from typing import List

from megalm.conversion.base import Architecture
from megalm.conversion.deepseek_v3 import DeepseekV3
from megalm.conversion.errors import ConversionError
from megalm.conversion.gpt2 import GPT2
from megalm.conversion.gptoss import GptOss
from megalm.conversion.llama import Llama
from megalm.conversion.mixtral import Mixtral

ARCHITECTURES: List[Architecture] = [Llama(), GPT2(), GptOss(), Mixtral(), DeepseekV3()]
MOE_MODEL_TYPES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "olmoe",
    "dbrx",
    "granitemoe",
    "jamba",
    "phimoe",
    "minimax",
    "llama4",
    "gpt_oss",
    "ernie4_5_moe",
    "glm4_moe",
)


def _moe_experts(m) -> int:
    return int(m.num_experts or 0)


def for_megalm(m) -> Architecture:
    """The mapping for megalm model config ``m``; the error lists why each candidate does not fit."""
    experts = _moe_experts(m)
    candidates = [arch for arch in ARCHITECTURES if arch.moe == bool(experts)]
    reasons = {}
    for arch in candidates:
        wrong = arch.megalm_mismatches(m)
        if not wrong:
            return arch
        reasons[arch.hf_class] = wrong
    detail = "; ".join(f"not {name}: {', '.join(w)}" for name, w in reasons.items())
    what = f"mixture-of-experts model ({experts} experts)" if experts else "model"
    raise ConversionError(f"no Hugging Face architecture matches this {what} ({detail})")


def for_hf(hf: dict) -> Architecture:
    """The mapping for a Hugging Face ``config.json``."""
    model_type = hf.get("model_type")
    for arch in ARCHITECTURES:
        if model_type in arch.hf_model_types:
            return arch
    moe = [a.hf_model_types[0] for a in ARCHITECTURES if a.moe]
    if model_type in MOE_MODEL_TYPES or hf.get("num_local_experts") or hf.get("num_experts"):
        raise ConversionError(
            f"config.json model_type = {model_type!r} is a mixture-of-experts model that megalm "
            f"cannot import (supported mixture-of-experts model types: {', '.join(moe)})"
        )
    known = ", ".join(t for a in ARCHITECTURES for t in a.hf_model_types)
    raise ConversionError(f"config.json model_type = {model_type!r} is not supported (supported: {known})")
