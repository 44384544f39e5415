"""Which checkpoint to resume from, verified: the tracker file and ``iter_NNNNNNN`` directory
names, finding the checkpoint ``--load`` / ``--ckpt-step`` name, Megatron's auto-resume decision,
and verification before any load (each rank hashes its share of the files against the manifests
of :mod:`megalm.checkpoint.manifest`; ``--ckpt-fallback-to-verified`` walks back to the newest
checkpoint that verifies).

Communication: :func:`verify_checkpoint` and :func:`verified_checkpoint` are collective (one
``all_gather_object`` over the world per checkpoint checked, :func:`gather_errors`); finding a
checkpoint and the auto-resume decision only read files.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import List, Optional

import torch.distributed as dist

from megalm.checkpoint import manifest as checkpoint_manifest
from megalm.checkpoint.errors import CheckpointError, gather_errors
from megalm.checkpoint.safe_metadata import CheckpointMetadataError, CheckpointSecurityError, load_metadata
from megalm.log import get_logger

logger = get_logger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_is_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# --- finding ---------------------------------------------------------------------------------


def read_tracker(root: str) -> Optional[int]:
    tracker = os.path.join(root, TRACKER_FILENAME)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} should hold an iteration number, found {text!r}") from None


def megatron_lm_format(path: str) -> Optional[str]:
    """How an iteration directory written by Megatron-LM says so (None when it does not look like one):
    ``metadata.json`` naming its sharded backend (``torch_dist``, ``zarr``), or legacy ``mp_rank_XX``
    directories of ``model_optim_rng.pt`` files."""
    if os.path.isfile(os.path.join(path, "common.json")):
        return None
    meta = os.path.join(path, "metadata.json")
    if os.path.isfile(meta):
        try:
            with open(meta) as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError):
            backend = None
        if backend:
            return f"metadata.json: sharded_backend {backend}"
    legacy = sorted(glob.glob(os.path.join(path, "mp_rank_*", "model_optim_rng.pt")))
    if legacy:
        return f"legacy format: {os.path.relpath(legacy[0], path)}"
    if os.path.isfile(os.path.join(path, ".metadata")) and not os.path.isfile(meta):
        return PLAIN_DCP
    return None


# How megatron_lm_format names a DCP directory with neither megalm's common.json nor Megatron's metadata.json.
PLAIN_DCP = "a .metadata without common.json or metadata.json: Megatron-LM's fsdp_dtensor (or torch_dcp) format"


def find_checkpoint(root: str, iteration: Optional[int] = None) -> Optional[str]:
    """The directory to load: ``iteration`` if given, else the tracker's; None if no checkpoint."""
    if not os.path.isdir(root):
        raise CheckpointError(f"--load directory {root} does not exist")
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            return None
    path = checkpoint_dir(root, iteration)
    foreign = megatron_lm_format(path)
    if foreign == PLAIN_DCP:
        raise CheckpointError(
            f"{path} is a Megatron-LM checkpoint ({foreign}), not a megalm one: megalm resumes the fsdp_dtensor "
            "checkpoints it writes itself (with their common.json); import this one first (weights and Adam's "
            f"state): python tools/checkpoint/convert.py --from megatron --load-dir {os.path.dirname(path)} "
            "--save-dir NEW_DIR, then train with --load NEW_DIR"
        )
    if foreign is not None:
        raise CheckpointError(
            f"{path} is a Megatron-LM checkpoint ({foreign}), not a megalm one: megalm cannot load it directly; "
            f"convert it first: python tools/checkpoint/convert.py --from megatron --load-dir {os.path.dirname(path)} "
            "--save-dir NEW_DIR, then train with --load NEW_DIR --finetune"
        )
    for needed in ("common.json", ".metadata"):
        if not os.path.isfile(os.path.join(path, needed)):
            raise CheckpointError(f"checkpoint {path} is incomplete or unreadable: {needed} is missing")
    return path


def non_persistent_dir(checkpoint_cfg, root: Optional[str]) -> Optional[str]:
    """Where non-persistent checkpoints live: ``--non-persistent-global-ckpt-dir``, else ``<root>/non_persistent``
    (``root``: ``--save`` when saving, ``--load`` when loading)."""
    c = checkpoint_cfg
    if c.non_persistent_global_ckpt_dir:
        return c.non_persistent_global_ckpt_dir
    return os.path.join(root, "non_persistent") if root else None


def newest_load_root(load: str, non_persistent: Optional[str]) -> str:
    """``load``, or the non-persistent directory when its checkpoint is newer (Megatron's rule)."""
    if not non_persistent or not os.path.isdir(non_persistent):
        return load
    other = read_tracker(non_persistent)
    if other is None:
        return load
    mine = read_tracker(load) if os.path.isdir(load) else None
    return non_persistent if mine is None or other > mine else load


def checkpoint_to_resume(
    load: str,
    save: Optional[str],
    ckpt_step: Optional[int] = None,
    exit_on_missing: bool = False,
    fallback: bool = False,
) -> bool:
    """Whether ``--load`` has a checkpoint to load (True), or training may start from scratch
    (False: Megatron's auto-resume, ``--load`` = ``--save`` with no checkpoint written yet).

    Anything else without a checkpoint raises :class:`CheckpointError`: a ``--load`` other than
    ``--save`` (most likely a wrong path), ``--ckpt-step``, ``--exit-on-missing-checkpoint``, or
    iteration directories without a tracker file (a checkpoint that was being written).
    ``fallback`` (``--ckpt-fallback-to-verified``): the checkpoint is not checked here but by
    :func:`verified_checkpoint` when it is loaded, which skips an incomplete one.
    """
    if ckpt_step is not None or (os.path.isdir(load) and read_tracker(load) is not None):
        if not fallback:  # with --ckpt-fallback-to-verified an incomplete one is skipped at load
            find_checkpoint(load, ckpt_step)  # a missing or incomplete one fails here, before any work
        return True
    why = None
    if exit_on_missing:
        why = "--exit-on-missing-checkpoint"
    elif save is None or os.path.abspath(load) != os.path.abspath(save):
        why = (
            "starting from scratch needs --load and --save to name the same directory (Megatron-style "
            "auto-resume); check the path"
        )
    elif os.path.isdir(load) and any(n.startswith("iter_") for n in os.listdir(load)):
        why = "it holds iter_* directories: restore or remove them, or write the tracker file by hand"
    if why is not None:
        raise CheckpointError(f"--load {load}: no checkpoint ({TRACKER_FILENAME} is missing); {why}")
    return False


# --- verification ------------------------------------------------------------------------


def checkpoint_iterations(root: str) -> List[int]:
    """The iterations of the ``iter_NNNNNNN`` directories under ``root``, newest first."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted((int(m.group(1)) for n in names if (m := re.fullmatch(r"iter_(\d{7})", n))), reverse=True)


def verify_checkpoint(path: str, iteration: int) -> Optional[str]:
    """Collective (all ranks, or none initialized): ``"FILE: reason"`` for the first problem
    found, or None if the checkpoint verifies.

    Each rank checks the files of the saved ranks ``r`` with ``r % world == rank`` (its own
    files when the world is unchanged), then one ``all_gather_object`` over the world shares the
    results, so every rank returns the same answer.  Rank 0 also checks that ``common.json``
    names this iteration.  A checkpoint without a manifest (written before megalm had them)
    verifies with a logged warning.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    failed = gather_errors(_verify_local(path, iteration, rank, world))
    return failed[0][1] if failed else None


def _verify_local(path: str, iteration: int, rank: int, world: int) -> Optional[str]:
    error = _check_common_iteration(path, iteration) if rank == 0 else None
    if error is not None:
        return error
    if not checkpoint_manifest.has_manifest(path):
        if os.path.isdir(os.path.join(path, checkpoint_manifest.RANK_DIR)):
            return f"{checkpoint_manifest.INDEX_FILENAME}: missing (the save never completed)"
        logger.warning(  # on every rank: each one loads its part unverified
            f"checkpoint {path} has no {checkpoint_manifest.INDEX_FILENAME} (written before "
            f"megalm verified checkpoints): loading it unverified"
        )
        return None
    index, error = checkpoint_manifest.read_index(path)
    if error is not None:
        return error
    mine = [r for r in checkpoint_manifest.saved_ranks(index) if r % world == rank]
    return checkpoint_manifest.verify_ranks(path, index, mine)


def _check_common_iteration(path: str, iteration: int) -> Optional[str]:
    for needed in ("common.json", ".metadata"):
        if not os.path.isfile(os.path.join(path, needed)):
            return f"{needed}: missing"
    try:
        with open(os.path.join(path, "common.json")) as f:
            saved = json.load(f).get("iteration")
    except (OSError, ValueError, AttributeError) as e:
        return f"common.json: unreadable ({type(e).__name__})"
    if saved != iteration:
        return f"common.json: says iteration {saved!r}, the directory is iteration {iteration}"
    return None


def _refuse_hostile_metadata(path: str, error: str) -> None:
    """A ``.metadata`` that fails verification and asks for something megalm never writes is an
    attack, not damage: its security refusal (naming the file) is raised, never skipped."""
    if error.startswith(".metadata:"):
        try:
            load_metadata(path)  # the restricted reader: runs nothing from the file
        except CheckpointSecurityError as e:
            raise CheckpointError(str(e)) from e
        except CheckpointMetadataError:
            pass


def verified_checkpoint(root: str, iteration: Optional[int] = None, fallback: bool = False) -> str:
    """Collective.  The directory to load (``iteration``, else the tracker's) after verifying it.

    Corrupt: :class:`CheckpointError` ``checkpoint DIR is corrupt: FILE: reason; previous:
    --ckpt-step N`` (N the newest older iteration directory), or with ``fallback`` the newest
    older checkpoint that verifies (a warning names each one skipped).
    """
    if not os.path.isdir(root):
        raise CheckpointError(f"--load directory {root} does not exist")
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise CheckpointError(f"no checkpoint in {root} (no {TRACKER_FILENAME})")
    older = [i for i in checkpoint_iterations(root) if i < iteration]
    for candidate in [iteration] + (older if fallback else []):
        path = checkpoint_dir(root, candidate)
        error = verify_checkpoint(path, candidate)
        if error is None:
            return path
        _refuse_hostile_metadata(path, error)
        previous = [i for i in older if i < candidate]
        hint = f"previous: --ckpt-step {previous[0]}" if previous else "no previous checkpoint"
        message = f"checkpoint {path} is corrupt: {error}; {hint}"
        if not fallback:
            raise CheckpointError(message)
        logger.warning(f"{message}: skipped (--ckpt-fallback-to-verified)")  # every rank skips it
    raise CheckpointError(f"no checkpoint in {root} verifies (newest: iteration {iteration}; see the warnings above)")
