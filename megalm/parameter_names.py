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

:func:`model_parameters`, :func:`tied_embedding_copies` and :func:`model_buffers` list a model's
tensors under these names (what a checkpoint saves, and what gradient compression keys its
layout-free state by).  No communication.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from megalm.tensor_parallel.param_info import param_info

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


def _is_tied_copy(name: str, p: torch.Tensor) -> bool:
    return param_info(p).copy_of is not None


def model_parameters(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, torch.nn.Parameter]:
    """Global parameter names -> parameters of this rank, skipping duplicate copies of tied weights.

    Names are canonical (:func:`canonical_name`): a Transformer Engine
    model's fused norm weights get the local names, so checkpoints are the same for both.
    """
    params: Dict[str, torch.nn.Parameter] = {}
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, p in module.named_parameters():
            if _is_tied_copy(name, p):
                continue  # the last stage's copy of a tied embedding: the first stage's is saved
            params[canonical_name(name)] = p
    return params


def tied_embedding_copies(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, tuple]:
    """``{copy name: (source name, parameter)}`` for the last pipeline stage's copies of a tied embedding.

    A copy is not saved (the first stage's embedding is) but is loaded from the source's tensors,
    weights and optimizer state alike: both copies receive the same summed gradient and the
    same update, so they are equal.  The source is the copy's ``param_info(p).copy_of`` (the word embedding).
    """
    out = {}
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        for name, p in module.named_parameters():
            if _is_tied_copy(name, p):
                out[name] = (param_info(p).copy_of, p)
    return out


def model_buffers(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, torch.Tensor]:
    """Global names -> persistent buffers (training state that is not a parameter, e.g. a router's
    ``expert_bias``); each is replicated over TP and DP."""
    out = {}
    for chunk in model_chunks:
        for prefix, module in getattr(chunk, "module", chunk).named_modules():
            for name, b in module._buffers.items():
                if b is not None and name not in module._non_persistent_buffers_set:
                    out[canonical_name(f"{prefix}.{name}" if prefix else name)] = b
    return out
