"""The model's and the optimizer's tensors as blocks of global tensors, under global names.

Model tensors are keyed ``model.<global parameter name>`` (names from
:func:`megalm.parameter_names.canonical_name`, so a Transformer Engine model's checkpoint is a local
one's) and described by :func:`megalm.param_layout.param_spec`: blocks of their full
(unpadded-vocabulary) tensors, so any TP/PP/DP layout can load them.  Persistent buffers (a router's
``expert_bias``) are replicated tensors under the same prefix.  Optimizer tensors are keyed
``optimizer.<global parameter name>.<state>`` with the parameter's layout (each optimizer describes
its blocks: :meth:`megalm.optimizer.optimizer.MegatronOptimizer.sharded_state_dict`).  The last
pipeline stage's copy of a tied embedding is not saved; it loads the first stage's tensors.

:class:`ModelOptimizerState` is the model and its optimizer as one registered checkpoint state
(:mod:`megalm.checkpoint.stateful`): whoever builds them registers it, as any other state, and the
checkpointer names neither.  No communication (but a ZeRO-3 model's gather of its sharded parameters).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from megalm.checkpoint.errors import CheckpointError
from megalm.checkpoint.stateful import CheckpointStates, LoadInfo
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


def load_targets(model_chunks, optimizer, saved: Dict[str, tuple], groups: ProcessGroups):
    """What to read into which tensor, given the names in the checkpoint.

    Model weights come from the fp32 main copy when the checkpoint has one and nothing else
    reads it (an fp32 model, or no optimizer state loaded): it is the more precise value.
    Missing fp32 main copies (a checkpoint of an fp32 run) are rebuilt from the weights.
    A last stage's tied embedding copy reads the embedding's weights and optimizer state.
    """
    params = model_parameters(model_chunks)
    for source, p in tied_embedding_copies(model_chunks).values():
        params.setdefault(source, p)  # a last stage's tied copy loads the embedding's tensors
    opt_specs = optimizer_sharded_state(optimizer, model_chunks, tied_copies=True) if optimizer is not None else {}
    missing = sorted(k for k in opt_specs if k not in saved)
    other_missing = [k for k in missing if not k.endswith(".main_param")]
    if other_missing:
        raise CheckpointError(
            f"checkpoint has no optimizer state for {other_missing[:3]} "
            f"({len(other_missing)} tensors); load with --no-load-optim to start a fresh optimizer"
        )
    for key in missing:
        del opt_specs[key]
    specs: ShardedStateDict = {}
    for name, p in params.items():
        main_key = f"optimizer.{name}.main_param"
        if main_key in saved and main_key not in opt_specs:
            specs[main_key] = param_spec(p, groups=groups)
        else:
            specs[f"model.{name}"] = param_spec(p, groups=groups)
    for name, b in model_buffers(model_chunks).items():
        if f"model.{name}" not in saved:
            raise CheckpointError(f"checkpoint has no {name}: it was saved by a model without it (check the MoE flags)")
        specs[f"model.{name}"] = ShardedTensorSpec.replicated(b)
    specs.update(opt_specs)
    return specs, bool(missing)


class ModelOptimizerState:
    """The model chunks and their optimizer as one checkpoint state (registered first, as ``model``, so
    that the optimizer is restored before the states that read it): their tensors go into the DCP
    checkpoint (``model.*``, ``optimizer.*``), the optimizer's non-tensor state into ``common.json``'s
    ``optimizer_common``; no per-rank file.

    ``save_optim`` False (``--no-save-optim``) leaves the optimizer out of a save (``optimizer_common``
    None); ``load_optim`` False (``--no-load-optim``, ``--finetune``) restores only the weights and
    rebuilds the optimizer's copies of them (``reload_model_params``).  The load plan reads a weight
    from the checkpoint's fp32 main copy when it has one and the optimizer does not read it
    (:func:`load_targets`)."""

    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        optimizer=None,
        groups: Optional[ProcessGroups] = None,
        save_optim: bool = True,
        load_optim: bool = True,
    ):
        self.model_chunks, self.optimizer = model_chunks, optimizer
        self.groups = model_groups(model_chunks, groups)
        self.save_optim = save_optim and optimizer is not None
        self.load_optim = load_optim and optimizer is not None
        self._main_params_missing = False  # set by the load plan: an fp32 checkpoint loaded with --bf16

    def state_dict(self) -> None:
        return None  # no per-rank file: everything is in the DCP checkpoint and common.json

    def load_state_dict(self, state) -> None:
        pass  # never called: there is no file

    def sharded_state_dict(self) -> ShardedStateDict:
        finish_param_sync(self.model_chunks)
        specs = model_sharded_state(self.model_chunks, self.groups)
        if self.save_optim:
            specs.update(optimizer_sharded_state(self.optimizer, self.model_chunks))
        return specs

    def common_state_dict(self) -> dict:
        return {"optimizer_common": self.optimizer.common_state_dict() if self.save_optim else None}

    def sharded_load_plan(self, info: LoadInfo) -> ShardedStateDict:
        finish_param_sync(self.model_chunks)
        optimizer = self.optimizer if self.load_optim else None
        specs, self._main_params_missing = load_targets(self.model_chunks, optimizer, info.saved_tensors, self.groups)
        return specs

    def load_common_state_dict(self, info: LoadInfo) -> None:
        """After the DCP load filled the tensors: the optimizer's own state, or its copies of the weights."""
        if self.load_optim:
            # Missing fp32 main weights (e.g. an fp32 checkpoint resumed with --bf16) are rebuilt from the model's.
            self.optimizer.load_sharded_state_dict(
                info.common.get("optimizer_common") or {}, main_params_loaded=not self._main_params_missing
            )
        elif self.optimizer is not None:
            self.optimizer.reload_model_params()


def with_model(model: ModelOptimizerState, states: Optional[CheckpointStates] = None) -> CheckpointStates:
    """``model`` registered as ``model``, then ``states``' registrations (for callers that hold a model and an
    optimizer rather than registered states: tools, tests, generation)."""
    out = CheckpointStates()
    out.register("model", model)
    for name, state in states.items() if states is not None else ():
        out.register(name, state)
    return out
