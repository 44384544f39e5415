"""Saving a training checkpoint: every rank's blocks through DCP, per-rank files, ``common.json``,
manifests, then the tracker (the layout is described in :mod:`megalm.checkpoint`)."""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megalm.checkpoint import fsdp_dtensor
from megalm.checkpoint import manifest as checkpoint_manifest
from megalm.checkpoint.async_writer import AsyncCheckpointWriter
from megalm.checkpoint.common_json import FORMAT_VERSION, layout
from megalm.checkpoint.dcp_io import save_sharded
from megalm.checkpoint.errors import CheckpointError, describe_io_error, gather_errors, save_dir_problem
from megalm.checkpoint.fsdp_dtensor import TORCH_DIST
from megalm.checkpoint.model_state import ModelOptimizerState, model_groups, with_model
from megalm.checkpoint.resume import TRACKER_FILENAME, checkpoint_dir, checkpoint_iterations, rank_is_zero, read_tracker
from megalm.checkpoint.stateful import CheckpointStates, common_states, save_rank_states, sharded_states
from megalm.parallel_state import ProcessGroups
from megalm.param_layout import ShardedStateDict, ShardedTensorSpec

# common.json's keys the checkpointer writes itself (registered states add theirs: common_state_dict)
COMMON_KEYS = ("format_version", "iteration", "world_size", "layout", "config", "extra", "saved_at", "ckpt_format")


def save_checkpoint(
    root: str,
    iteration: int,
    model_chunks,
    optimizer=None,
    config: Optional[dict] = None,
    extra: Optional[dict] = None,
    async_writer: Optional[AsyncCheckpointWriter] = None,
    states: Optional[CheckpointStates] = None,
    groups: Optional[ProcessGroups] = None,
    ckpt_format: str = TORCH_DIST,
) -> str:
    """:func:`save_checkpoint_states` of ``model_chunks`` and ``optimizer`` (registered first, as a
    :class:`megalm.checkpoint.model_state.ModelOptimizerState`) and ``states``, for callers that hold a
    model rather than registered states (tools, tests).  ``optimizer`` None (``--no-save-optim``) leaves
    its state out; loading it then needs ``--no-load-optim``.  ``groups``: the run's process groups
    (default: the model's own, :func:`megalm.checkpoint.model_state.model_groups`)."""
    groups = model_groups(model_chunks, groups)
    model = ModelOptimizerState(model_chunks, optimizer, groups)
    states = with_model(model, states)
    return save_checkpoint_states(root, iteration, states, groups, config, extra, async_writer, ckpt_format)


def save_checkpoint_states(
    root: str,
    iteration: int,
    states: CheckpointStates,
    groups: ProcessGroups,
    config: Optional[dict] = None,
    extra: Optional[dict] = None,
    async_writer: Optional[AsyncCheckpointWriter] = None,
    ckpt_format: str = TORCH_DIST,
) -> str:
    """Collective over all ranks.  Returns the iteration directory.

    ``states``: the registered states (:mod:`megalm.checkpoint.stateful`; the trainer's: model and
    optimizer, LR scheduler, data position, RNG and its features'): their blocks go into the DCP save
    (collective per state), each rank writes its ``<name>/rank_<rank>.pt``, and their ``common.json``
    entries join the checkpointer's own (:data:`COMMON_KEYS`).  ``groups``: the run's process groups
    (the layout ``common.json`` records).

    Communication: a barrier once rank 0 has prepared the directory; with fsdp_dtensor one
    ``all_gather_object`` (which parameters have main copies); DCP's save (its plan
    gather/scatter and the final gather of write results); one ``all_gather_object`` of every
    rank's outcome once its files and manifest are written, and one after rank 0 wrote the
    manifest index and the tracker (a failure on any rank raises :class:`CheckpointError` on
    every rank, the tracker left on the previous checkpoint).  With ``async_writer``
    (``--async-save``) the tensors are staged to CPU now and all but the first barrier run in
    the background on the writer's group (see :mod:`megalm.checkpoint.async_writer`).

    ``ckpt_format`` (``--ckpt-format``): ``torch_dist`` (megalm's keys), or ``fsdp_dtensor``: the same blocks
    under Megatron-FSDP's keys and Megatron-LM's pickled entries (:mod:`megalm.checkpoint.fsdp_dtensor`;
    needs ``config``), recorded in ``common.json``'s ``ckpt_format``."""
    if ckpt_format not in fsdp_dtensor.FORMATS:
        raise CheckpointError(f"checkpoint format {ckpt_format!r}: megalm writes {' and '.join(fsdp_dtensor.FORMATS)}")
    if ckpt_format == fsdp_dtensor.FSDP_DTENSOR and config is None:
        raise CheckpointError("an fsdp_dtensor checkpoint needs the run's config (its args entry)")
    if async_writer is not None:
        async_writer.wait()  # one save in flight: the previous one is complete (tracker written) first
    path = checkpoint_dir(root, iteration)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.isdir(path):
            shutil.rmtree(path)  # a stale, never-completed save of this iteration
    _barrier()
    specs = sharded_states(states)  # collective per state (e.g. a sum over data-parallel ranks)
    with _write_errors(path):
        save_rank_states(path, states)
    entries = common_states(states, taken=COMMON_KEYS)  # on every rank: a refusal stops every rank here
    common, objects = None, None
    if ckpt_format == fsdp_dtensor.FSDP_DTENSOR:
        gated = fsdp_dtensor.is_gated(config)
        mains = fsdp_dtensor.main_copies(specs)  # collective
        te, grouped = fsdp_dtensor.uses_te_names(config), fsdp_dtensor.uses_grouped_experts(config)
        specs = fsdp_dtensor.to_disk(specs, gated, mains, te_names=te, grouped=grouped)
        if rank == 0:
            objects = fsdp_dtensor.megatron_entries(iteration, config, entries)
    if rank == 0:
        common = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "world_size": world,
            "layout": layout(groups),
            "config": config,
            "extra": extra or {},
            "saved_at": time.time(),
            **entries,
        }
        if ckpt_format != TORCH_DIST:  # torch_dist checkpoints keep the keys they always had
            common["ckpt_format"] = ckpt_format
    if async_writer is None:
        _on_every_rank(lambda: _write_files(specs, path, common, rank, objects=objects), path)
        _on_every_rank(lambda: _finish_save(root, path, iteration, world), path)
        return path
    staged = stage_to_cpu(specs)
    group = async_writer.group

    def write_in_background():
        _on_every_rank(lambda: _write_files(staged, path, common, rank, group, objects), path, group)
        _on_every_rank(lambda: _finish_save(root, path, iteration, world), path, group)

    async_writer.submit(iteration, write_in_background)
    return path


def _write_files(
    specs: ShardedStateDict, path: str, common: Optional[dict], rank: int, group=None, objects=None
) -> None:
    """This rank's part of a save after the per-rank state files: DCP data (DCP's collectives over ``group``;
    ``objects``: byte entries beside the tensors), ``common.json`` (rank 0), then its manifest."""
    save_sharded(specs, path, process_group=group, objects=objects)
    _write_common(path, common)
    checkpoint_manifest.write_rank_manifest(path, rank)


def _on_every_rank(step, path: str, group=None) -> None:
    """Run ``step()`` here, then one ``all_gather_object`` over ``group`` (default: the world) of
    every rank's outcome: every rank raises a :class:`CheckpointError` when any rank failed (no
    rank is left waiting for one that gave up), and on return every rank's step is complete."""
    error = None
    try:
        with _write_errors(path):
            step()
    except CheckpointError as e:
        error = e
    failed = gather_errors(str(error) if error else None, group)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} failed: {failed[0][1]}")


def _finish_save(root: str, path: str, iteration: int, world: int) -> None:
    """Rank 0, once every rank's manifest is written: the manifest index, then the tracker."""
    if rank_is_zero():
        checkpoint_manifest.write_index(path, iteration, world)
        _write_tracker(root, iteration)


@contextmanager
def _write_errors(path: str):
    """Turn a failed write (OSError, torch's RuntimeError, DCP's CheckpointException, which is a
    BaseException) into a one-line :class:`CheckpointError` naming ``path``."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot write checkpoint {path}: {describe_io_error(e, path)}") from e


def remove_older_checkpoints(root: str) -> None:
    """Delete the iteration directories of ``root`` older than its tracker's (the newest complete one);
    one still being written in the background is newer and stays.  Rank 0 only."""
    newest = read_tracker(root)
    if newest is None:
        return
    for it in checkpoint_iterations(root):
        if it < newest:
            shutil.rmtree(checkpoint_dir(root, it), ignore_errors=True)


def check_save_dir(save: str) -> None:
    """``--save`` is a writable directory or can be created as one: fails at start, naming the path
    (:func:`megalm.checkpoint.errors.save_dir_problem`; nothing is created)."""
    problem = save_dir_problem(save)
    if problem is not None:
        raise CheckpointError(f"--save {save} {problem}")


def stage_to_cpu(specs: ShardedStateDict) -> ShardedStateDict:
    """A copy of every block in new CPU memory (what an asynchronous save writes; a block with a source, the
    NVMe offload's swapped state, is read from it: the background write needs a snapshot)."""

    def copy(spec: ShardedTensorSpec) -> ShardedTensorSpec:
        local = spec.local.detach().to("cpu", copy=True) if spec.source is None else spec.data()
        return ShardedTensorSpec(local, spec.global_shape, spec.offsets)

    return {k: [copy(s) for s in v] if isinstance(v, list) else copy(v) for k, v in specs.items()}


def _write_common(path: str, common: Optional[dict]) -> None:
    """Rank 0 (the one holding ``common``) writes ``common.json``, after the tensors."""
    if common is not None:
        _write_atomic(os.path.join(path, "common.json"), json.dumps(common, indent=1))


def _write_tracker(root: str, iteration: int) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write_atomic(os.path.join(root, TRACKER_FILENAME), str(iteration))


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
