"""Global parameter names: one naming for checkpoints, optimizer state and initialization seeds.

The local implementation's names are the canonical ones (``decoder.layers.3.input_layernorm.weight``,
the keys of every megalm checkpoint and of the Hugging Face conversion).  A model built with
``--transformer-impl transformer_engine`` holds some parameters under Transformer Engine's
names, the layout Megatron-LM's TE layers have: the input norm of the attention and the norm
before the MLP are fused into the following ``LayerNormLinear``, so their weights live there::

    TE module tree                                      canonical (local) name
    self_attention.linear_qkv.layer_norm_weight    ->   input_layernorm.weight
    self_attention.linear_qkv.layer_norm_bias      ->   input_layernorm.bias
    mlp.linear_fc1.layer_norm_weight               ->   pre_mlp_layernorm.weight
    mlp.linear_fc1.layer_norm_bias                 ->   pre_mlp_layernorm.bias

Every other TE parameter (``weight`` / ``bias`` of ``linear_qkv``, ``linear_proj``,
``linear_fc1``, ``linear_fc2``) already has its local name, shape and tensor-parallel layout.
:func:`canonical_name` is applied wherever a name leaves the module tree (checkpoint keys,
optimizer-state keys, the init seed), so a TE model starts from the same weights as a local
one for the same ``--seed`` and either implementation loads the other's checkpoints.
"""

from __future__ import annotations

# (suffix in a TE model, the same tensor's canonical suffix); matched after a "." or at the start.
TE_ALIASES = (
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
)


def canonical_name(name: str) -> str:
    """The local implementation's name of parameter ``name`` (unchanged when it already is one)."""
    for alias, canonical in TE_ALIASES:
        if name == alias or name.endswith("." + alias):
            return name[: len(name) - len(alias)] + canonical
    return name
