"""The model's and the optimizer's tensors as blocks of global tensors, under global names.

Model tensors are keyed ``model.<global parameter name>`` (names from
:func:`megalm.parameter_names.canonical_name`, so a Transformer Engine model's checkpoint is a local
one's) and described by :func:`megalm.param_layout.param_spec`: blocks of their full
(unpadded-vocabulary) tensors, so any TP/PP/DP layout can load them.  Persistent buffers (a router's
``expert_bias``) are replicated tensors under the same prefix.  Optimizer tensors are keyed
``optimizer.<global parameter name>.<state>`` with the parameter's layout (each optimizer describes
its blocks: :meth:`megalm.optimizer.optimizer.MegatronOptimizer.sharded_state_dict`).  The last
pipeline stage's copy of a tied embedding is not saved; it loads the first stage's tensors.
No communication.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from megalm.param_layout import ShardedStateDict, ShardedTensorSpec, param_spec
from megalm.parameter_names import canonical_name
from megalm.tensor_parallel.param_info import param_info


def finish_param_sync(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Wait for pending parameter all-gathers (distributed optimizer with overlapped gathers);
    with sharded parameters (ZeRO-3) gather them whole."""
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_param_sync", None)
        if finish is not None:
            finish()
        gather = getattr(chunk, "gather_params", None)
        if gather is not None:
            gather()


def _is_tied_copy(name: str, p: torch.Tensor) -> bool:
    return param_info(p).copy_of is not None


def model_parameters(model_chunks: Sequence[torch.nn.Module]) -> Dict[str, torch.nn.Parameter]:
    """Global parameter names -> parameters of this rank, skipping duplicate copies of tied weights.

    Names are canonical (:func:`megalm.parameter_names.canonical_name`): a Transformer Engine
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


def model_sharded_state(model_chunks: Sequence[torch.nn.Module]) -> ShardedStateDict:
    specs = {f"model.{name}": param_spec(p) for name, p in model_parameters(model_chunks).items()}
    specs.update({f"model.{name}": ShardedTensorSpec.replicated(b) for name, b in model_buffers(model_chunks).items()})
    return specs


def optimizer_sharded_state(optimizer, model_chunks, tied_copies: bool = False) -> ShardedStateDict:
    """Optimizer tensors (main weights, moments) keyed ``optimizer.<global parameter name>.<state>``.

    Each optimizer describes its own blocks of the full tensors
    (:meth:`megalm.optimizer.optimizer.MegatronOptimizer.sharded_state_dict`: the local TP shard
    of each parameter, or the distributed optimizer's ranges).  ``tied_copies`` (for loading):
    also the state of tied embedding copies, under their source's keys.
    """
    params = model_parameters(model_chunks)
    renames = {}
    if tied_copies:
        for name, (source, p) in tied_embedding_copies(model_chunks).items():
            if source not in params:
                params[name] = p
                renames[f"optimizer.{name}."] = f"optimizer.{source}."
    specs = optimizer.sharded_state_dict(params)
    for old, new in renames.items():
        specs = {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in specs.items()}
    return specs
