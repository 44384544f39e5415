"""Megatron-LM's distributed optimizer in its ``dp_reshardable`` format -> Adam state per parameter.

megatron-core's ``DistributedOptimizer`` keeps Adam's state in flat buffers laid out like its DDP's
param-and-grad buffers, and its ``dp_reshardable`` checkpoint format (Megatron-LM's default since
core 0.14) saves each bucket as one 1-D tensor per state::

    optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_(param dtype, grad dtype).bucket_idx_K.S

``S`` in ``param`` (the fp32 main weights), ``exp_avg``, ``exp_avg_sq``; the tensor's length is the
bucket's unpadded length.  Inside a bucket megatron-core's ``_ParamAndGradBuffer`` places the
parameters one after the other, in REVERSE module order, each starting at a multiple of 64 elements
(the distributed optimizer's alignment); a bucket ends after the parameter that fills its saved
length.  No parameter names are saved, so :func:`place_parameters` finds each parameter's range by
its values: the ``param`` buffer holds the fp32 main weights, which equal the saved model weights
(exactly for an fp32 run, after rounding to the weights' dtype for a bf16 / fp16 one).  The module
order (:func:`expected_order`) only breaks ties between parameters whose values are equal.  A range
no parameter matches, or a parameter left unplaced, refuses the import of the optimizer state
(the weights still import).  Read for a single model-parallel rank (one ``dp_group_idx``): TP / PP
ranks hold their own shards under other indices, not merged here.  No communication.
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Tuple

import torch

from megalm.conversion.errors import ConversionError
from megalm.parameter_names import canonical_name

FLAT_KEY = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)\.bucket_idx_(\d+)\.(\w+)$"
)
PARAM_ALIGN = 64  # megatron-core pads each parameter's start to a multiple of 64 elements
FLAT_STATES = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

# Parameter order inside one megatron-core transformer layer (module registration order of the local
# and Transformer Engine specs); a name not listed sorts after the listed ones, by name.
_LAYER_ORDER = (
    "input_layernorm.",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.layer_norm_",
    "self_attention.linear_qkv.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "pre_mlp_layernorm.",
    "mlp.linear_fc1.layer_norm_",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
    "mlp.router.",
    "mlp.experts.",
    "mlp.shared_experts.",
)
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def flat_buckets(keys: Sequence[str]) -> Dict[Tuple[int, int, str, int], Dict[str, str]]:
    """``{(dp group index, buffer index, dtype tag, bucket index): {state: checkpoint key}}`` of the
    ``dp_reshardable`` keys among ``keys``."""
    out: Dict[Tuple[int, int, str, int], Dict[str, str]] = {}
    for key in keys:
        found = FLAT_KEY.match(key)
        if found and found.group(5) in FLAT_STATES:
            group, gbuf, dtype, bucket, state = found.groups()
            out.setdefault((int(group), int(gbuf), dtype, int(bucket)), {})[state] = key
    return out


def _sort_key(name: str):
    name = canonical_name(name)  # a local-spec model saves its norms under TE's names
    layer = _LAYER.match(name)
    if name.startswith("embedding."):
        return (0, 0, 0, 0, name)
    if layer is None:  # final norm, then the output layer
        return (2, 0, 0, 0 if name.startswith("decoder.") else 1, name)
    rest = layer.group(2)
    rank = next((i for i, p in enumerate(_LAYER_ORDER) if rest.startswith(p)), len(_LAYER_ORDER))
    expert = _EXPERT.search(rest)
    return (1, int(layer.group(1)), rank, int(expert.group(1)) if expert else -1, name)


def expected_order(names: Sequence[str]) -> List[str]:
    """``names`` in the order megatron-core's buffers hold them: the reverse of the model's order."""
    return sorted(names, key=_sort_key, reverse=True)


def _matches(flat: torch.Tensor, weight: torch.Tensor) -> bool:
    return torch.equal(flat.to(weight.dtype), weight.reshape(-1))


def place_parameters(
    buckets: List[Dict[str, torch.Tensor]], weights: Dict[str, torch.Tensor], source: str
) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{state: {parameter name: tensor of its shape}}`` from ``buckets`` (each ``{state: flat
    tensor}``, in buffer and bucket order) and the saved model ``weights`` (every trainable
    parameter, Megatron's names and full shapes); raises :class:`ConversionError` when the buffers
    do not hold exactly these parameters."""
    remaining = expected_order(list(weights))
    out: Dict[str, Dict[str, torch.Tensor]] = {s: {} for s in FLAT_STATES.values()}
    for b, bucket in enumerate(buckets):
        if set(bucket) != set(FLAT_STATES):
            raise ConversionError(f"{source}: bucket {b} holds the states {sorted(bucket)}, not {sorted(FLAT_STATES)}")
        main, length, offset = bucket["param"], bucket["param"].numel(), 0
        while offset < length:
            start = -(-offset // PARAM_ALIGN) * PARAM_ALIGN
            name = next(
                (
                    n
                    for n in remaining
                    if start + weights[n].numel() <= length
                    and _matches(main[start : start + weights[n].numel()], weights[n])
                ),
                None,
            )
            if name is None:
                raise ConversionError(
                    f"{source}: no saved weight matches the fp32 main weights at element {start} of bucket {b}"
                )
            remaining.remove(name)
            end = start + weights[name].numel()
            for state, ours in FLAT_STATES.items():
                out[ours][name] = bucket[state][start:end].reshape(weights[name].shape)
            offset = end
    if remaining:
        raise ConversionError(f"{source}: the optimizer buffers hold no state for {remaining[:3]}")
    return out
