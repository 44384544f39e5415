"""Transformer building blocks: attention, rotary embedding, MLP, norms, layer and block."""

from megalm.transformer.attention import SelfAttention
from megalm.transformer.mlp import MLP
from megalm.transformer.norm import LayerNorm, RMSNorm, build_norm
from megalm.transformer.rope import RotaryEmbedding, apply_rotary
from megalm.transformer.transformer_block import TransformerBlock
from megalm.transformer.transformer_layer import TransformerLayer

__all__ = ["SelfAttention", "MLP", "LayerNorm", "RMSNorm", "build_norm", "RotaryEmbedding", "apply_rotary",
           "TransformerBlock", "TransformerLayer"]
