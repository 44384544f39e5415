"""Loading a training checkpoint under any parallel layout: verify it, read its blocks through DCP,
restore the per-rank files that apply to this layout (the layout is described in :mod:`megalm.checkpoint`)."""

from __future__ import annotations

from typing import Optional

from torch.distributed.checkpoint.api import CheckpointException

from megalm.checkpoint import fsdp_dtensor
from megalm.checkpoint.common_json import layout, read_common
from megalm.checkpoint.dcp_io import load_sharded, tensor_shapes
from megalm.checkpoint.errors import CheckpointError, describe_io_error
from megalm.checkpoint.model_state import ModelOptimizerState, model_groups, with_model
from megalm.checkpoint.resume import verified_checkpoint
from megalm.checkpoint.safe_metadata import CheckpointMetadataError, load_metadata
from megalm.checkpoint.stateful import CheckpointStates, LoadInfo, load_rank_states, sharded_load_plans
from megalm.log import get_logger
from megalm.parallel_state import ProcessGroups

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
    ckpt_format: Optional[str] = None,
) -> dict:
    """:func:`load_checkpoint_states` of ``model_chunks`` and ``optimizer`` (registered first, as a
    :class:`megalm.checkpoint.model_state.ModelOptimizerState`) and ``states``, for callers that hold a
    model rather than registered states (tools, tests, generation).  Returns common.json's content.

    ``finetune`` loads the weights only and reports iteration 0.  ``fallback``
    (``--ckpt-fallback-to-verified``): a corrupt checkpoint is skipped for the newest older one
    that verifies.  ``states`` (:mod:`megalm.checkpoint.stateful`) are restored after the
    optimizer, from ``common.json``, this rank's files and their blocks of the DCP checkpoint (not with
    ``finetune``; a state to restore later, e.g. the RNG after the data loaders drew from it, is left out
    here and given to :func:`load_states`).  ``groups``: the run's process groups (default: the model's
    own, :func:`megalm.checkpoint.model_state.model_groups`).
    """
    groups = model_groups(model_chunks, groups)
    model = ModelOptimizerState(model_chunks, optimizer, groups, load_optim=load_optim and not finetune)
    states = with_model(model, None if finetune else states)
    common = load_checkpoint_states(root, states, groups, iteration, fallback, ckpt_format)
    if finetune:
        common = dict(common, iteration=0, consumed_train_samples=0, consumed_valid_samples=0)
    return common


def load_checkpoint_states(
    root: str,
    states: CheckpointStates,
    groups: ProcessGroups,
    iteration: Optional[int] = None,
    fallback: bool = False,
    ckpt_format: Optional[str] = None,
    auto_detect: bool = False,
) -> dict:
    """Collective.  Verifies the checkpoint (:func:`verified_checkpoint`; ``iteration`` None: the
    tracker's), reads the blocks every registered state asks for (their ``sharded_load_plan``) in one DCP
    load, then restores each state in registration order from ``common.json`` and this rank's file
    (:func:`megalm.checkpoint.stateful.load_rank_states`).  Returns common.json's content plus ``path``.
    ``fallback`` (``--ckpt-fallback-to-verified``): a corrupt checkpoint is skipped for the newest older
    one that verifies.  ``groups``: the run's process groups (the layout the per-rank files must match).
    ``ckpt_format`` (``--ckpt-format``; None: any): a checkpoint in the other format loads only with
    ``auto_detect`` (``--auto-detect-ckpt-format``); an fsdp_dtensor one's keys are translated
    (:mod:`megalm.checkpoint.fsdp_dtensor`), so that the states ask for megalm's keys either way."""
    path = verified_checkpoint(root, iteration, fallback)
    common = read_common(path)
    found = fsdp_dtensor.saved_format(common)
    fsdp_dtensor.check_format(path, found, ckpt_format, auto_detect)
    try:  # read once, safely (refuses anything but DCP metadata; fsdp_dtensor's pickled entries are never read)
        metadata = load_metadata(path, allow_byte_entries=found == fsdp_dtensor.FSDP_DTENSOR)
    except CheckpointMetadataError as e:
        raise CheckpointError(str(e)) from e
    saved = tensor_shapes(metadata)
    if found == fsdp_dtensor.FSDP_DTENSOR:
        info = LoadInfo(path, common, layout(groups), fsdp_dtensor.megalm_shapes(saved))
        specs = fsdp_dtensor.to_load(sharded_load_plans(states, info), saved)
    else:
        info = LoadInfo(path, common, layout(groups), saved)
        specs = sharded_load_plans(states, info)
    try:
        load_sharded(specs, path, metadata=metadata)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"failed to load {path}: {describe_io_error(e, path, writing=False)}") from e
    load_rank_states(info, states)  # collective: one all_gather_object per state
    return dict(common, path=path)


def load_states(
    path: str, common: dict, groups: ProcessGroups, states: CheckpointStates, held: Optional[dict] = None
) -> None:
    """Restore registered ``states`` from the checkpoint :func:`load_checkpoint` loaded (``path``, its
    ``common``), later than the rest (collective: one ``all_gather_object`` per state).  ``held``: a local
    checkpoint's state dicts of this rank (``"held"`` of what :meth:`LocalCheckpoint.restore` returned), read
    instead of the per-rank files."""
    load_rank_states(LoadInfo(path, common, layout(groups), {}, held), states)
