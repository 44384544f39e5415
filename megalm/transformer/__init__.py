"""Transformer building blocks: attention, rotary embedding, MLP, norms, layer and block; their
Transformer Engine versions (``te_layers``) and the fp8 region (``fp8``)."""

from megalm.transformer.attention import SelfAttention
from megalm.transformer.mlp import MLP
from megalm.transformer.norm import LayerNorm, RMSNorm, build_norm
from megalm.transformer.rope import RotaryEmbedding, apply_rotary
from megalm.transformer.te_layers import TEMLP, TESelfAttention
from megalm.transformer.transformer_block import TransformerBlock
from megalm.transformer.transformer_layer import TransformerLayer

__all__ = [
    "SelfAttention",
    "MLP",
    "LayerNorm",
    "RMSNorm",
    "build_norm",
    "RotaryEmbedding",
    "apply_rotary",
    "TEMLP",
    "TESelfAttention",
    "TransformerBlock",
    "TransformerLayer",
]
