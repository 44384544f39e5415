"""``--ckpt-format fsdp_dtensor``: the tensors under the names and shapes of Megatron-FSDP's checkpoints.

Megatron-LM saves a Megatron-FSDP run with ``--ckpt-format fsdp_dtensor`` as one plain
torch.distributed.checkpoint (DCP) directory of the module's own ``state_dict()`` (DTensors) and of the
distributed optimizer's per-parameter state (Megatron-LM ``megatron/training/checkpointing.py``:
``generate_state_dict`` and ``preprocess_fsdp_dtensor_state_dict``;
``megatron/core/optimizer/distrib_optimizer.py``: ``sharded_param_state_fsdp_dtensor``;
``megatron/core/transformer/fsdp_dtensor_checkpoint.py``: ``handle_swiglu_in_state_dict``; the converter
``tools/checkpoint/checkpoint_inspector.py convert-torch-dist-to-fsdp-dtensor`` writes the same keys).
On disk (DCP stores a DTensor as its global shape and the chunks the ranks hold, exactly as megalm's blocks)::

    model.module.<name>                                    weights (fp32 main copy when there is one)
    model.module.<...>.linear_fc1.weight_w / weight_v      a gated MLP's fc1 as its two halves (gate, up)
    optimizer.state.module.module.module.<name>.exp_avg    the optimizer's state of each parameter
    iteration, checkpoint_version (3.0), args              pickled objects (DCP byte entries)
    opt_param_scheduler.<field>                            the LR scheduler's state

The prefixes are the wrappers' attribute paths: ``module.`` of the FSDP wrapper for the model,
``module.module.module.`` of the optimizer's model chunks.  megalm's blocks keep every property of its
torch_dist checkpoints: any TP/PP/DP/EP layout loads them, DCP reshards; the per-rank files (RNG, data
position), ``common.json`` and the manifests sit beside them as in any megalm checkpoint (Megatron-LM
ignores files it does not read; its fsdp_dtensor load is partial, so it takes the keys it knows).

What differs from a Megatron-FSDP checkpoint: no ``rng_state`` and ``rerun_state_machine`` entries
(megalm's RNG is in its per-rank files), no ``optimizer.param_to_group_meta`` (megalm keeps the
hyper-parameters in ``common.json``), and a parameter's ``step`` is a 1-element tensor.  The names are those
of the module tree Megatron-LM builds for the run's flags: Transformer Engine's fused norms
(``linear_qkv.layer_norm_weight``) with ``--transformer-impl transformer_engine``, and with ``--moe-grouped-gemm``
too its grouped experts (``mlp.experts.linear_fc1.weight<global index>``); SequentialMLP's
``mlp.experts.local_experts.<global index>`` otherwise.
"""

from __future__ import annotations

import argparse
import io
import re
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from megalm.checkpoint.errors import CheckpointError
from megalm.param_layout import ShardedStateDict, ShardedTensorSpec
from megalm.parameter_names import TE_ALIASES, canonical_name

TORCH_DIST = "torch_dist"
FSDP_DTENSOR = "fsdp_dtensor"
FORMATS = (TORCH_DIST, FSDP_DTENSOR)
MODEL = "model.module."
OPTIMIZER_STATE = "optimizer.state.module.module.module."
CHECKPOINT_VERSION = 3.0  # what Megatron-LM's checkpointing.py writes as checkpoint_version
MAIN_PARAM = "main_param"  # megalm's fp32 main copy: Megatron-FSDP's model weights are that copy

# A gated MLP's fc1 (weight or bias), split into _w (gate) and _v (up) halves on disk.  megalm holds a dense
# one as its (2, n) view, an expert's as the whole [2n, ...] tensor (megalm.param_layout.param_spec).
_DENSE_FC1 = re.compile(r"(^|\.)(mlp|mlp\.shared_experts)\.linear_fc1\.(weight|bias)$")
_EXPERT_FC1 = re.compile(r"\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.(weight|bias)$")


class CheckpointFormatError(CheckpointError):
    """The checkpoint's format is not the one ``--ckpt-format`` names (and no ``--auto-detect-ckpt-format``)."""


def saved_format(common: dict) -> str:
    """The format a megalm checkpoint was written in (``common.json``'s ``ckpt_format``; torch_dist before it)."""
    return common.get("ckpt_format") or TORCH_DIST


def check_format(path: str, found: str, requested: Optional[str], auto_detect: bool) -> None:
    """A checkpoint in another format than ``--ckpt-format`` loads only with ``--auto-detect-ckpt-format``
    (as in Megatron-LM); ``requested`` None (tools, tests): whatever it is."""
    if requested is None or auto_detect or found == requested:
        return
    raise CheckpointFormatError(
        f"checkpoint {path} is in the {found} format, this run gives --ckpt-format {requested}: "
        f"give --ckpt-format {found} or --auto-detect-ckpt-format to load it"
    )


def is_gated(config: Optional[dict]) -> bool:
    """Whether the MLPs are gated (SwiGLU, quick-GEGLU), from a ``MegalmConfig.to_dict()``."""
    model = (config or {}).get("model") or {}
    return bool(model.get("swiglu") or model.get("quick_geglu"))


# --- names ---------------------------------------------------------------------------------------


def _parse(key: str) -> Tuple[str, str, str]:
    """megalm key -> (kind, parameter name, state): ``model.X`` ("model", X, ""), ``optimizer.X.S``
    ("optimizer", X, S); any other key (a feature's own tensors) ("other", key, "")."""
    if key.startswith("model."):
        return "model", key[len("model.") :], ""
    if key.startswith("optimizer."):
        name, state = key[len("optimizer.") :].rsplit(".", 1)
        return "optimizer", name, state
    return "other", key, ""


# An expert's tensors in a SequentialMLP (megalm's names) and in Transformer Engine's grouped experts
# (TEGroupedMLP, Megatron's --moe-grouped-gemm with TE: one weight<index> per expert of one module).
_SEQUENTIAL = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)(_w|_v)?")
_GROUPED = re.compile(r"(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)(_w|_v)?")


def _grouped_name(name: str) -> str:
    m = _SEQUENTIAL.fullmatch(name)
    return f"{m[1]}.{m[3]}.{m[4]}{m[2]}{m[5] or ''}" if m else name


def _sequential_name(name: str) -> str:
    m = _GROUPED.fullmatch(name)
    return f"{m[1]}.local_experts.{m[4]}.{m[2]}.{m[3]}{m[5] or ''}" if m else name


def uses_grouped_experts(config: Optional[dict]) -> bool:
    """Whether Megatron's model of this config holds its experts as TEGroupedMLP (``--moe-grouped-gemm`` with
    ``--transformer-impl transformer_engine``), named ``mlp.experts.linear_fc1.weight<index>``."""
    model = (config or {}).get("model") or {}
    return bool(model.get("moe_grouped_gemm")) and uses_te_names(config)


def _key(kind: str, name: str, state: str, grouped: bool = False) -> str:
    """The on-disk key of parameter ``name``'s weights (kind "model", or the optimizer's ``main_param``) or
    its optimizer ``state``; ``grouped``: experts under TEGroupedMLP's names."""
    if grouped and kind != "other":
        name = _grouped_name(name)
    if kind == "model" or (kind == "optimizer" and state == MAIN_PARAM):
        return MODEL + name
    if kind == "optimizer":
        return f"{OPTIMIZER_STATE}{name}.{state}"
    return name


def megalm_key(key: str) -> str:
    """The megalm key of an on-disk key (a split fc1 half keeps its ``_w`` / ``_v`` name)."""
    if key.startswith(MODEL):
        return "model." + key[len(MODEL) :]
    if key.startswith(OPTIMIZER_STATE):
        return "optimizer." + key[len(OPTIMIZER_STATE) :]
    return key


def _split_mode(name: str, global_shape, gated_experts: bool) -> Optional[str]:
    """How parameter ``name``'s tensor splits into its _w / _v halves: "select" (the (2, n) view of a
    dense fc1), "halves" (an expert's [2n, ...]), or None (not split)."""
    if _DENSE_FC1.search(name) and len(global_shape) == (3 if name.endswith("weight") else 2):
        return "select"
    if gated_experts and _EXPERT_FC1.search(name):
        return "halves"
    return None


def _split_block(spec: ShardedTensorSpec, mode: str) -> List[Tuple[str, ShardedTensorSpec]]:
    """``spec``'s parts in the _w and _v tensors (views of ``spec.local``: a load fills them in place; with its
    source, the NVMe offload's swap files, when it has one)."""
    g, off, local = list(spec.global_shape), list(spec.offsets), spec.local
    out = []
    if mode == "select":  # (2, n, ...): index 0 is the gate, 1 the up projection
        for i in range(local.shape[0]):
            half = "_w" if off[0] + i == 0 else "_v"
            out.append((half, ShardedTensorSpec(local.select(0, i), g[1:], off[1:], spec.source)))
        return out
    n = g[0] // 2  # [2n, ...]: rows [0, n) the gate, [n, 2n) the up projection
    start, end = off[0], off[0] + local.shape[0]
    for half, lo, hi in (("_w", 0, n), ("_v", n, 2 * n)):
        a, b = max(start, lo), min(end, hi)
        if a < b:
            part = local.narrow(0, a - start, b - a)
            out.append((half, ShardedTensorSpec(part, [n] + g[1:], [a - lo] + off[1:], spec.source)))
    return out


def main_copies(specs: ShardedStateDict) -> Set[str]:
    """Collective (one ``all_gather_object`` over the world): the parameters with an fp32 main copy on any
    rank.  A distributed optimizer's rank may hold no range of a parameter, and so no main-copy block, while
    others do: every rank must agree that the weights come from the main copy, or a rank would write the
    model's whole tensor over the others' blocks."""
    mine = sorted(_parse(k)[1] for k in specs if k.startswith("optimizer.") and k.endswith("." + MAIN_PARAM))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return set(mine)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name for names in gathered for name in names}


def uses_te_names(config: Optional[dict]) -> bool:
    """Whether the model is Transformer Engine's (``--transformer-impl transformer_engine``), whose module
    tree, and so Megatron-FSDP's checkpoint, holds the fused norms under the following linear's name."""
    return ((config or {}).get("model") or {}).get("transformer_impl") == "transformer_engine"


def _te_name(name: str, weights) -> str:
    """Transformer Engine's module name of parameter ``name`` (canonical): a norm fused into the following
    ``LayerNormLinear`` (:data:`megalm.parameter_names.TE_ALIASES`) where the layer has that linear (an MoE
    layer's ``pre_mlp_layernorm`` and MLA's input norm stay separate norms, as in Megatron's TE spec)."""
    for alias, canonical in TE_ALIASES:
        if name == canonical or name.endswith("." + canonical):
            prefix = name[: len(name) - len(canonical)]
            if prefix + alias.rsplit(".", 1)[0] + ".weight" in weights:
                return prefix + alias
    return name


def to_disk(
    specs: ShardedStateDict,
    gated_experts: bool,
    mains: Optional[Set[str]] = None,
    loading: bool = False,
    te_names: bool = False,
    grouped: bool = False,
) -> ShardedStateDict:
    """megalm's blocks (``model.*``, ``optimizer.*``, features' keys) under the on-disk keys.

    The model's weights come from the optimizer's fp32 main copy when it has one (as Megatron-FSDP's,
    whose parameters are that copy); otherwise from the model.  ``gated_experts``: the experts' fc1 are gated
    (:func:`is_gated`); ``mains``: the parameters whose weights are saved from the main copy
    (:func:`main_copies`; None: this rank's).  A split fc1's state of another shape than the weight
    (Adam's ``step``) goes to both halves, as Megatron-FSDP copies it (a load reads the ``_w`` one).
    ``loading``: a load plan, whose weights and main copy both read the same key (its blocks list both's).
    ``te_names``: the norms under Transformer Engine's names (:func:`uses_te_names`, :func:`_te_name`);
    ``grouped``: the experts under TEGroupedMLP's (:func:`uses_grouped_experts`)."""
    shapes: Dict[str, tuple] = {}  # parameter name -> global shape of its weight (in megalm's view)
    for key, value in specs.items():
        kind, name, state = _parse(key)
        blocks = value if isinstance(value, list) else [value]
        if blocks and (kind == "model" or state == MAIN_PARAM):
            shapes[name] = tuple(blocks[0].global_shape)
    if mains is None:
        mains = {_parse(k)[1] for k in specs if k.startswith("optimizer.") and k.endswith("." + MAIN_PARAM)}
    out: Dict[str, List[ShardedTensorSpec]] = {}
    for key, value in specs.items():
        kind, name, state = _parse(key)
        if kind == "model" and name in mains and not loading:
            continue  # saved from the main copy
        blocks = value if isinstance(value, list) else [value]
        if not blocks:
            continue
        mode = _split_mode(name, shapes[name], gated_experts) if name in shapes and kind != "other" else None
        if te_names and kind != "other":
            name = _te_name(name, shapes)
        if mode is None:
            out.setdefault(_key(kind, name, state, grouped), []).extend(blocks)
        elif tuple(blocks[0].global_shape) != shapes[name]:  # a per-parameter value: in both halves
            for half in ("_w",) if loading else ("_w", "_v"):
                out.setdefault(_key(kind, name + half, state, grouped), []).extend(blocks)
        else:
            for spec in blocks:
                for half, part in _split_block(spec, mode):
                    out.setdefault(_key(kind, name + half, state, grouped), []).append(part)
    return {k: v[0] if len(v) == 1 else v for k, v in out.items()}


def to_load(specs: ShardedStateDict, saved: Dict[str, tuple]) -> ShardedStateDict:
    """A load plan's blocks (megalm keys) under the on-disk keys of the checkpoint whose tensors are
    ``saved`` (on-disk keys -> shapes): the model's weights and the main copy both read ``model.module.*``."""
    gated_experts = any(
        _EXPERT_FC1.search(_sequential_name(megalm_key(k)[len("model.") :])[: -len("_w")])
        for k in saved
        if k.startswith(MODEL) and k.endswith("_w")
    )
    te_names = any(k.endswith((".layer_norm_weight", ".layer_norm_bias")) for k in saved)
    grouped = any(_GROUPED.fullmatch(_parse(megalm_key(k))[1]) for k in saved if k.startswith(MODEL))
    return to_disk(specs, gated_experts, mains=set(), loading=True, te_names=te_names, grouped=grouped)


def megalm_shapes(saved: Dict[str, tuple]) -> Dict[str, tuple]:
    """The checkpoint's tensors (on-disk keys -> shapes) under megalm's keys, as a load plan asks for them:
    split fc1 halves joined, and each weight also as the optimizer's ``main_param`` (the same tensor)."""
    out: Dict[str, tuple] = {}
    for key, shape in saved.items():
        mk = megalm_key(key)
        kind, name, state = _parse(mk) if key.startswith((MODEL, OPTIMIZER_STATE)) else ("other", mk, "")
        disk_name = name  # of the weight's own key
        if kind != "other":
            name = _sequential_name(name)
        if name.endswith(("_w", "_v")) and (_DENSE_FC1.search(name[:-2]) or _EXPERT_FC1.search(name[:-2])):
            if tuple(shape) == tuple(saved.get(MODEL + disk_name, ())):  # weight-shaped (not Adam's step)
                shape = (2,) + tuple(shape) if _DENSE_FC1.search(name[:-2]) else (2 * shape[0],) + tuple(shape[1:])
            name = name[:-2]
        if kind != "other":
            name = canonical_name(name)  # a Transformer Engine norm name
        if kind == "model":
            out[f"model.{name}"] = tuple(shape)
            out[f"optimizer.{name}.{MAIN_PARAM}"] = tuple(shape)
        elif kind == "optimizer":
            out[f"optimizer.{name}.{state}"] = tuple(shape)
        else:
            out[name] = tuple(shape)
    return out


# --- the non-tensor entries ----------------------------------------------------------------------


def megatron_entries(iteration: int, config: Optional[dict], common: dict) -> Dict[str, bytes]:
    """The pickled entries Megatron-LM's loader reads first (``iteration``, ``checkpoint_version``,
    ``args``: a Namespace of megalm's config fields, which carry Megatron's argument names) and the LR
    scheduler's state (``common``: the registered states' ``common.json`` entries, its ``scheduler``) as
    ``opt_param_scheduler.<field>``.  Written by rank 0; megalm never reads them."""
    scheduler = common.get("scheduler")

    def pickled(value) -> bytes:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer.getvalue()

    args = {k: v for section in (config or {}).values() if isinstance(section, dict) for k, v in section.items()}
    out = {
        "iteration": pickled(iteration),
        "checkpoint_version": pickled(CHECKPOINT_VERSION),
        "args": pickled(argparse.Namespace(**args)),
    }
    for field, value in (scheduler if isinstance(scheduler, dict) else {}).items():
        out[f"opt_param_scheduler.{field}"] = pickled(value)
    return out
