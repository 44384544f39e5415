"""Loading a training checkpoint under any parallel layout: verify it, read its blocks through DCP,
restore the per-rank files that apply to this layout (the layout is described in :mod:`megalm.checkpoint`)."""

from __future__ import annotations

from typing import Dict, Optional

from torch.distributed.checkpoint.api import CheckpointException

from megalm.checkpoint.common_json import layout, read_common
from megalm.checkpoint.dcp_io import load_sharded, tensor_shapes
from megalm.checkpoint.errors import CheckpointError, describe_io_error
from megalm.checkpoint.model_state import (
    finish_param_sync,
    model_buffers,
    model_groups,
    model_parameters,
    optimizer_sharded_state,
    tied_embedding_copies,
)
from megalm.checkpoint.resume import verified_checkpoint
from megalm.checkpoint.safe_metadata import CheckpointMetadataError, load_metadata
from megalm.checkpoint.stateful import CheckpointStates, LoadInfo, load_rank_states, sharded_load_plans
from megalm.log import get_logger
from megalm.parallel_state import ProcessGroups
from megalm.param_layout import ShardedStateDict, ShardedTensorSpec, param_spec

logger = get_logger(__name__)


def load_checkpoint(
    root: str,
    model_chunks,
    optimizer=None,
    load_optim: bool = True,
    finetune: bool = False,
    iteration: Optional[int] = None,
    fallback: bool = False,
    states: Optional[CheckpointStates] = None,
    groups: Optional[ProcessGroups] = None,
) -> dict:
    """Collective.  Verifies the checkpoint (:func:`verified_checkpoint`), fills the model (and
    optimizer, registered ``states``) in place; returns common.json's content.

    ``finetune`` loads the weights only and reports iteration 0.  ``fallback``
    (``--ckpt-fallback-to-verified``): a corrupt checkpoint is skipped for the newest older one
    that verifies.  ``states`` (:mod:`megalm.checkpoint.stateful`) are restored after the
    optimizer, from ``common.json``, this rank's files and their blocks of the DCP checkpoint (not with
    ``finetune``; a state to restore later, e.g. the RNG after the data loaders drew from it, is left out
    here and given to :func:`load_states`).  ``groups``: the run's process groups (default: the model's
    own, :func:`model_groups`).
    """
    path = verified_checkpoint(root, iteration, fallback)
    common = read_common(path)
    try:
        metadata = load_metadata(path)  # read once, safely (refuses anything but DCP metadata)
    except CheckpointMetadataError as e:
        raise CheckpointError(str(e)) from e
    saved = tensor_shapes(metadata)
    finish_param_sync(model_chunks)
    groups = model_groups(model_chunks, groups)
    with_optim = optimizer is not None and load_optim and not finetune
    specs, main_params_missing = load_targets(model_chunks, optimizer if with_optim else None, saved, groups)
    info = LoadInfo(path, common, layout(groups), saved)
    states = None if finetune else states
    specs.update(sharded_load_plans(states, info))
    try:
        load_sharded(specs, path, metadata=metadata)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"failed to load {path}: {describe_io_error(e, path, writing=False)}") from e
    if with_optim:
        # Missing fp32 main weights (e.g. an fp32 checkpoint resumed with --bf16) are rebuilt from the model's.
        optimizer.load_sharded_state_dict(
            common.get("optimizer_common") or {}, main_params_loaded=not main_params_missing
        )
    elif optimizer is not None:
        optimizer.reload_model_params()
    load_rank_states(info, states)  # collective: one all_gather_object per state
    common = dict(common, path=path)
    if finetune:
        common = dict(common, iteration=0, consumed_train_samples=0, consumed_valid_samples=0)
    return common


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


def load_states(
    path: str, common: dict, groups: ProcessGroups, states: CheckpointStates, held: Optional[dict] = None
) -> None:
    """Restore registered ``states`` from the checkpoint :func:`load_checkpoint` loaded (``path``, its
    ``common``), later than the rest (collective: one ``all_gather_object`` per state).  ``held``: a local
    checkpoint's state dicts of this rank (``"held"`` of what :meth:`LocalCheckpoint.restore` returned), read
    instead of the per-rank files."""
    load_rank_states(LoadInfo(path, common, layout(groups), {}, held), states)
