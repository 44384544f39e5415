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

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megalm.checkpoint.errors import CheckpointError
from megalm.parallel_state import ProcessGroups
from megalm.param_layout import (
    ShardedStateDict,
    ShardedTensorSpec,
    model_buffers,
    model_parameters,
    param_spec,
    tied_embedding_copies,
)


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


def model_groups(model_chunks: Sequence[torch.nn.Module], groups: Optional[ProcessGroups] = None) -> ProcessGroups:
    """``groups`` when given, else the process groups the model was built with (a DDP wrapper's or a
    GPTModel's ``process_groups``); a plain module that holds none is this process alone in a single
    process, and needs ``groups`` passed in a distributed run (nothing is looked up)."""
    if groups is not None:
        return groups
    for chunk in model_chunks:
        for module in (chunk, getattr(chunk, "module", None)):
            held = getattr(module, "process_groups", None)
            if isinstance(held, ProcessGroups):
                return held
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise CheckpointError(
            "the model holds no process groups (no process_groups attribute): pass groups= to the checkpointer"
        )
    return ProcessGroups.single()


def model_sharded_state(
    model_chunks: Sequence[torch.nn.Module], groups: Optional[ProcessGroups] = None
) -> ShardedStateDict:
    groups = model_groups(model_chunks, groups)
    specs = {f"model.{name}": param_spec(p, groups=groups) for name, p in model_parameters(model_chunks).items()}
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
