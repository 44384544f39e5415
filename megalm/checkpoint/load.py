"""Loading a training checkpoint under any parallel layout: verify it, read its blocks through DCP,
restore the per-rank files that apply to this layout (the layout is described in :mod:`megalm.checkpoint`)."""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megalm import parallel_state
from megalm.checkpoint.common_json import layout, read_common
from megalm.checkpoint.dcp_io import load_sharded, tensor_shapes
from megalm.checkpoint.errors import CheckpointError, describe_io_error, first_line, gather_errors
from megalm.checkpoint.model_state import (
    finish_param_sync,
    model_buffers,
    model_parameters,
    optimizer_sharded_state,
    tied_embedding_copies,
)
from megalm.checkpoint.resume import verified_checkpoint
from megalm.checkpoint.rng import set_rng_state
from megalm.checkpoint.safe_metadata import CheckpointMetadataError, load_metadata
from megalm.checkpoint.save import _compression_file, _local_sgd_file, _tp
from megalm.distributed.compression.state import LayoutFreeState, restore_compression_state, signature
from megalm.log import get_logger
from megalm.param_layout import ShardedStateDict, ShardedTensorSpec, param_spec

logger = get_logger(__name__)


def load_checkpoint(
    root: str,
    model_chunks,
    optimizer=None,
    scheduler=None,
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    iteration: Optional[int] = None,
    fallback: bool = False,
) -> dict:
    """Collective.  Verifies the checkpoint (:func:`verified_checkpoint`), fills the model (and
    optimizer/scheduler/RNG) in place; returns common.json's content.

    ``finetune`` loads the weights only and reports iteration 0.  ``fallback``
    (``--ckpt-fallback-to-verified``): a corrupt checkpoint is skipped for the newest older one
    that verifies.
    """
    path = verified_checkpoint(root, iteration, fallback)
    common = read_common(path)
    try:
        metadata = load_metadata(
            path
        )  # read once, by megalm.checkpoint.safe_metadata (refuses anything but DCP metadata)
    except CheckpointMetadataError as e:
        raise CheckpointError(str(e)) from e
    saved = tensor_shapes(metadata)
    finish_param_sync(model_chunks)
    with_optim = optimizer is not None and load_optim and not finetune
    specs, main_params_missing = _load_specs(model_chunks, optimizer if with_optim else None, saved)
    layout_free = None if finetune else _compression_targets(model_chunks, saved)
    if layout_free is not None:
        specs.update(layout_free.specs)
    try:
        load_sharded(specs, path, metadata=metadata)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"failed to load {path}: {describe_io_error(e, path, writing=False)}") from e
    if with_optim:
        # Missing fp32 main weights (e.g. an fp32 checkpoint resumed with --bf16) are rebuilt from the model's.
        optimizer.load_sharded_state_dict(
            common.get("optimizer_common") or {}, main_params_loaded=not main_params_missing
        )
        if scheduler is not None and common.get("scheduler") is not None:
            scheduler.load_state_dict(common["scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()
    if not finetune:
        load_compression_state(path, common, model_chunks, layout_free)
    if load_rng and not finetune:
        load_rng_state(path, common)
    common = dict(common, path=path)
    if finetune:
        common = dict(common, iteration=0, consumed_train_samples=0, consumed_valid_samples=0)
    return common


def _load_specs(model_chunks, optimizer, saved: Dict[str, tuple]):
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
            specs[main_key] = param_spec(p)
        else:
            specs[f"model.{name}"] = param_spec(p)
    for name, b in model_buffers(model_chunks).items():
        if f"model.{name}" not in saved:
            raise CheckpointError(f"checkpoint has no {name}: it was saved by a model without it (check the MoE flags)")
        specs[f"model.{name}"] = ShardedTensorSpec.replicated(b)
    specs.update(opt_specs)
    return specs, bool(missing)


def _compression_targets(model_chunks, saved: Dict[str, tuple]) -> Optional[LayoutFreeState]:
    """Load: what of the layout-independent ``--grad-compression`` state to read, or None without compression."""
    if signature(model_chunks, {}) is None:
        return None
    params, copies = model_parameters(model_chunks), tied_embedding_copies(model_chunks)
    pp1 = parallel_state.get_pipeline_model_parallel_world_size() == 1
    return LayoutFreeState(model_chunks, params, copies, _tp(), saved, absorb_copies=pp1)


def load_compression_state(path: str, common: dict, model_chunks, layout_free=None) -> None:
    """Restore this rank's ``--grad-compression`` state exactly (same layout and settings); else
    reshard it from the checkpoint's pending updates (``layout_free``, read by the DCP load:
    :mod:`megalm.distributed.compression.reshard`; one INFO line), or, when the checkpoint has none
    (saved without compression or before they were saved), warn that it restarts from zero.
    No communication."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = _compression_file(path, rank)
    saved = None
    if common.get("layout") == layout() and os.path.isfile(file):
        try:
            saved = torch.load(file, weights_only=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: {first_line(e)}") from None
    elif common.get("layout") != layout():
        saved = {"signature": f"layout {common.get('layout')}"}
    why = restore_compression_state(model_chunks, layout(), saved)
    if why is not None and layout_free is not None and layout_free.found:
        done = layout_free.apply(model_chunks)
        logger.info(f"gradient-compression state resharded from {path} ({why}): {done}")
    elif why is not None:
        logger.warning(
            f"gradient-compression state (error-feedback residuals) not restored from {path}: {why}; "
            f"it restarts from zero"
        )


def load_local_sgd_state(path: str, common: dict, outer_sync) -> None:
    """``--local-sgd-interval``: after :func:`load_checkpoint`, put back this rank's replica (weights,
    inner optimizer state) and the outer state; under another layout, or from a checkpoint without
    them, every replica keeps the loaded weights and the outer state restarts from them (a warning).
    No communication."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = _local_sgd_file(path, rank)
    if common.get("layout") == layout() and os.path.isfile(file):
        try:
            state = torch.load(file, weights_only=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: {first_line(e)}") from None
        outer_sync.load_state_dict(state)
        return
    why = "it has none" if common.get("layout") == layout() else f"it was saved with layout {common.get('layout')}"
    outer_sync.reset()
    logger.warning(
        f"local SGD: the replicas' own weights and optimizer states are not restored from {path} ({why}, now "
        f"{layout()}): every replica starts from the checkpoint's weights, the outer state from them"
    )


def load_rng_state(path: str, common: dict) -> None:
    """Collective (one ``all_gather_object``).  Restore this rank's RNG states (skipped, with a
    message, when the layout changed)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not common.get("rng_saved", True):
        raise CheckpointError(f"{path} was saved with --no-save-rng: load it with --no-load-rng")
    if common.get("world_size") != world or common.get("layout") != layout():
        logger.info(
            f"checkpoint was saved with layout {common.get('layout')}, now {layout()}: RNG states are not restored"
        )
        return
    file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    state, error = None, None
    try:
        state = torch.load(file, weights_only=True)
    except (OSError, RuntimeError, ValueError) as e:
        error = f"cannot read {file}: {first_line(e)}"
    failed = gather_errors(error)  # collective: a rank that cannot read its file stops every rank
    if failed:
        raise CheckpointError(failed[0][1])
    set_rng_state(state)
