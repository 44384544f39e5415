"""Training checkpoints: save, find the latest, load under any parallel layout.

Directory layout (Megatron-like)::

    <save>/latest_checkpointed_iteration.txt   # written last, atomically: the iteration number
    <save>/iter_0000020/
        .metadata, __*_*.distcp                # DCP: model weights and optimizer tensors
        common.json                            # iteration, consumed samples, config, scheduler, scaler
        rng/rank_00000.pt ...                  # per-rank RNG states (tensors only; weights_only load)
        grad_compression/rank_00000.pt ...     # --grad-compression: per-rank residuals (idem)
        local_sgd/rank_00000.pt ...            # --local-sgd-interval: each replica's weights, optimizer (idem)
        manifest/rank_00000.json ...           # per rank: size and sha256 of each file it wrote
        manifest.json                          # rank 0, after every rank's manifest, before the tracker

Every load verifies the checkpoint first (:func:`megalm.checkpoint_resume.verify_checkpoint`, each
rank hashing its share of the files, see :mod:`megalm.checkpoint_manifest`): a corrupt one fails with
``checkpoint DIR is corrupt: FILE: reason; previous: --ckpt-step N``, or with
``--ckpt-fallback-to-verified`` the newest older checkpoint that verifies is loaded instead.
A checkpoint written before manifests existed loads with a logged warning.  Write failures
(full disk included: the message says "No space left on device") raise :class:`CheckpointError`
naming the directory.

Model tensors are keyed ``model.<global parameter name>`` and stored as blocks of their
full (unpadded-vocabulary) tensors, so any TP/PP/DP layout can load them (see
:mod:`megalm.dist_checkpointing`).  Optimizer tensors are keyed
``optimizer.<global parameter name>.<state>`` with the parameter's layout; the distributed
optimizer saves, for each parameter range of its data-parallel shard, the blocks of the full
tensor that range covers (:func:`megalm.param_layout.param_range_specs`), with no gather: the same keys and the
same global tensors as the plain optimizer, so either loads the other's checkpoints under any
TP/PP/DP layout.  With ``--grad-compression`` the pending update of error feedback (the sum of the
data-parallel ranks' residuals) is saved as ``grad_compression.<name>.pending`` with the parameter's
layout, and PowerSGD's warm starts as ``grad_compression.<name>.powersgd_q...``: a run under another
layout reshards them (:mod:`megalm.distributed.compression.reshard`).  Nothing from a checkpoint
can run code on load: DCP's ``.metadata`` is read by :mod:`megalm.safe_unpickle` (an exact
allow-list), tensors and RNG states by ``torch.load(weights_only=True)``, ``common.json`` as JSON.

Only parameters are saved.  Transformer Engine modules also carry ``_extra_state`` (fp8 scaling
metadata: amax history and scales, a pickled object): it is not saved, so a TE checkpoint is
exactly a local one (same names, see :mod:`megalm.parameter_names`) and no object state is loaded;
after a load fp8 scaling restarts from fresh amax statistics (``--fp8-amax-history-len`` steps).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from contextlib import contextmanager
from typing import Dict, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megalm import checkpoint_manifest, parallel_state
from megalm.async_save import AsyncCheckpointWriter
from megalm.checkpoint_io_errors import describe_io_error, first_line, save_dir_problem
from megalm.checkpoint_resume import (  # noqa: F401  (re-exported: checkpointing.verify_checkpoint etc.)
    TRACKER_FILENAME,
    CheckpointError,
    checkpoint_dir,
    checkpoint_iterations,
    checkpoint_to_resume,
    find_checkpoint,
    gather_errors,
    rank_is_zero,
    read_tracker,
    verified_checkpoint,
    verify_checkpoint,
)
from megalm.dist_checkpointing import (
    ShardedStateDict,
    ShardedTensorSpec,
    load_sharded,
    save_sharded,
    saved_tensor_shapes,  # noqa: F401 (read from here by tests and tools)
    tensor_shapes,
)
from megalm.distributed.compression.state import (
    LayoutFreeState,
    compression_state,
    layout_free_specs,
    restore_compression_state,
    signature,
)
from megalm.log import get_logger
from megalm.param_layout import param_spec
from megalm.parameter_names import canonical_name
from megalm.safe_unpickle import CheckpointMetadataError, load_metadata
from megalm.tensor_parallel.param_info import param_info

logger = get_logger(__name__)

FORMAT_VERSION = 1


# --- describing the model's tensors as blocks of global tensors ------------------------


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
    groups = _groups()
    specs = {f"model.{name}": param_spec(p, groups=groups) for name, p in model_parameters(model_chunks).items()}
    specs.update({f"model.{name}": ShardedTensorSpec.replicated(b) for name, b in model_buffers(model_chunks).items()})
    return specs


# --- RNG -------------------------------------------------------------------------------


def get_rng_state() -> Dict[str, object]:
    from megalm.tensor_parallel.random import get_rng_tracker

    np_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch": torch.get_rng_state(),
        "tracker": {k: v for k, v in get_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, object]) -> None:
    from megalm.tensor_parallel.random import get_rng_tracker

    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])


# --- save --------------------------------------------------------------------------------


def save_checkpoint(
    root: str,
    iteration: int,
    model_chunks,
    optimizer=None,
    scheduler=None,
    consumed_train_samples: int = 0,
    consumed_valid_samples: int = 0,
    config: Optional[dict] = None,
    extra: Optional[dict] = None,
    async_writer: Optional[AsyncCheckpointWriter] = None,
    save_rng: bool = True,
    outer_sync=None,
) -> str:
    """Collective over all ranks.  Returns the iteration directory.

    Communication: a barrier once rank 0 has prepared the directory; DCP's save (its plan
    gather/scatter and the final gather of write results); one ``all_gather_object`` of every
    rank's outcome once its files and manifest are written, and one after rank 0 wrote the
    manifest index and the tracker (a failure on any rank raises :class:`CheckpointError` on
    every rank, the tracker left on the previous checkpoint).  With ``async_writer``
    (``--async-save``) the tensors are staged to CPU now and all but the first barrier run in
    the background on the checkpoint-io group (see :mod:`megalm.async_save`).  ``optimizer`` /
    ``scheduler`` None (``--no-save-optim``) or ``save_rng`` False (``--no-save-rng``) leave their
    state out; ``common.json`` says so, and loading it then needs ``--no-load-optim`` / ``--no-load-rng``.
    ``outer_sync`` (``--local-sgd-interval``, :class:`megalm.distributed.local_sgd.OuterSync`): this rank's
    replica and the outer state are also written to ``local_sgd/rank_<rank>.pt``."""
    if async_writer is not None:
        async_writer.wait()  # one save in flight: the previous one is complete (tracker written) first
    path = checkpoint_dir(root, iteration)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.isdir(path):
            shutil.rmtree(path)  # a stale, never-completed save of this iteration
        os.makedirs(os.path.join(path, "rng"), exist_ok=True)
    _barrier()
    finish_param_sync(model_chunks)
    specs = model_sharded_state(model_chunks)
    if optimizer is not None:
        specs.update(optimizer_sharded_state(optimizer, model_chunks))
    specs.update(_compression_specs(model_chunks))  # collective: the pending update, summed over DP
    with _write_errors(path):
        if save_rng:
            torch.save(get_rng_state(), os.path.join(path, "rng", f"rank_{rank:05d}.pt"))
        _save_compression_state(model_chunks, path, rank)
        if outer_sync is not None:
            os.makedirs(os.path.join(path, "local_sgd"), exist_ok=True)
            torch.save(outer_sync.state_dict(), _local_sgd_file(path, rank))
    common = None
    if rank == 0:
        common = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "consumed_train_samples": consumed_train_samples,
            "consumed_valid_samples": consumed_valid_samples,
            "world_size": world,
            "layout": _layout(),
            "config": config,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "optimizer_common": optimizer.common_state_dict() if optimizer is not None else None,
            "extra": extra or {},
            "rng_saved": save_rng,
            "saved_at": time.time(),
        }
    if async_writer is None:
        _on_every_rank(lambda: _write_files(specs, path, common, rank), path)
        _on_every_rank(lambda: _finish_save(root, path, iteration, world), path)
        return path
    staged = stage_to_cpu(specs)
    group = parallel_state.get_checkpoint_io_group() if dist.is_initialized() else None

    def write_in_background():
        _on_every_rank(lambda: _write_files(staged, path, common, rank, group), path, group)
        _on_every_rank(lambda: _finish_save(root, path, iteration, world), path, group)

    async_writer.submit(iteration, write_in_background)
    return path


def _write_files(specs: ShardedStateDict, path: str, common: Optional[dict], rank: int, group=None) -> None:
    """This rank's part of a save after the RNG file: DCP data (DCP's collectives over ``group``),
    ``common.json`` (rank 0), then its manifest."""
    save_sharded(specs, path, process_group=group)
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
    (:func:`megalm.checkpoint_io_errors.save_dir_problem`; nothing is created)."""
    problem = save_dir_problem(save)
    if problem is not None:
        raise CheckpointError(f"--save {save} {problem}")


def stage_to_cpu(specs: ShardedStateDict) -> ShardedStateDict:
    """A copy of every block in new CPU memory (what an asynchronous save writes)."""

    def copy(spec: ShardedTensorSpec) -> ShardedTensorSpec:
        local = spec.local.detach().to("cpu", copy=True)
        return ShardedTensorSpec(local, spec.global_shape, spec.offsets)

    return {k: [copy(s) for s in v] if isinstance(v, list) else copy(v) for k, v in specs.items()}


def _write_common(path: str, common: Optional[dict]) -> None:
    """Rank 0 (the one holding ``common``) writes ``common.json``, after the tensors."""
    if common is not None:
        _write_atomic(os.path.join(path, "common.json"), json.dumps(common, indent=1))


def _write_tracker(root: str, iteration: int) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write_atomic(os.path.join(root, TRACKER_FILENAME), str(iteration))


def _layout() -> dict:
    """The layout a checkpoint records (per-rank state such as compression residuals is kept only under an
    equal one); the expert-tensor-parallel size only when > 1, so earlier checkpoints keep comparing equal."""
    layout = {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
    }
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    return layout if etp == 1 else {**layout, "expert_tensor_parallel_size": etp}


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


# --- optimizer adapters ------------------------------------------------------------------


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


# --- load --------------------------------------------------------------------------------


def read_common(path: str) -> dict:
    try:
        with open(os.path.join(path, "common.json")) as f:
            common = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}/common.json: {e}") from None
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {common.get('format_version')!r}")
    return common


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
        metadata = load_metadata(path)  # read once, by megalm.safe_unpickle (refuses anything but DCP metadata)
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
            specs[main_key] = param_spec(p, groups=_groups())
        else:
            specs[f"model.{name}"] = param_spec(p, groups=_groups())
    for name, b in model_buffers(model_chunks).items():
        if f"model.{name}" not in saved:
            raise CheckpointError(f"checkpoint has no {name}: it was saved by a model without it (check the MoE flags)")
        specs[f"model.{name}"] = ShardedTensorSpec.replicated(b)
    specs.update(opt_specs)
    return specs, bool(missing)


def _compression_file(path: str, rank: int) -> str:
    return os.path.join(path, "grad_compression", f"rank_{rank:05d}.pt")


def _save_compression_state(model_chunks, path: str, rank: int) -> None:
    """This rank's ``--grad-compression`` state (residuals, PowerSGD's Q, the rounding generator)."""
    state = compression_state(model_chunks, _layout())
    if state is not None:
        os.makedirs(os.path.join(path, "grad_compression"), exist_ok=True)
        torch.save(state, _compression_file(path, rank))


def _groups():
    """This rank's process groups.  The checkpointer still reads them from parallel_state (it is
    being rebuilt as the megalm/checkpoint/ package, which takes them from whoever builds it)."""
    return parallel_state.get_process_groups()


def _tp() -> tuple:
    groups = _groups()
    return parallel_state.group_rank(groups.tp), parallel_state.group_size(groups.tp)


def _compression_specs(model_chunks) -> dict:
    """Save: the layout-independent ``--grad-compression`` state (:func:`layout_free_specs`); collective."""
    if signature(model_chunks, {}) is None:
        return {}
    params, copies = model_parameters(model_chunks), tied_embedding_copies(model_chunks)
    return layout_free_specs(model_chunks, params, copies, _tp(), groups=_groups())


def _compression_targets(model_chunks, saved: Dict[str, tuple]) -> Optional[LayoutFreeState]:
    """Load: what of the layout-independent ``--grad-compression`` state to read, or None without compression."""
    if signature(model_chunks, {}) is None:
        return None
    params, copies = model_parameters(model_chunks), tied_embedding_copies(model_chunks)
    pp1 = parallel_state.get_pipeline_model_parallel_world_size() == 1
    return LayoutFreeState(model_chunks, params, copies, _tp(), saved, absorb_copies=pp1, groups=_groups())


def load_compression_state(path: str, common: dict, model_chunks, layout_free=None) -> None:
    """Restore this rank's ``--grad-compression`` state exactly (same layout and settings); else
    reshard it from the checkpoint's pending updates (``layout_free``, read by the DCP load:
    :mod:`megalm.distributed.compression.reshard`; one INFO line), or, when the checkpoint has none
    (saved without compression or before they were saved), warn that it restarts from zero.
    No communication."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = _compression_file(path, rank)
    saved = None
    if common.get("layout") == _layout() and os.path.isfile(file):
        try:
            saved = torch.load(file, weights_only=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: {first_line(e)}") from None
    elif common.get("layout") != _layout():
        saved = {"signature": f"layout {common.get('layout')}"}
    why = restore_compression_state(model_chunks, _layout(), saved)
    if why is not None and layout_free is not None and layout_free.found:
        done = layout_free.apply(model_chunks)
        logger.info(f"gradient-compression state resharded from {path} ({why}): {done}")
    elif why is not None:
        logger.warning(
            f"gradient-compression state (error-feedback residuals) not restored from {path}: {why}; "
            f"it restarts from zero"
        )


def _local_sgd_file(path: str, rank: int) -> str:
    return os.path.join(path, "local_sgd", f"rank_{rank:05d}.pt")


def load_local_sgd_state(path: str, common: dict, outer_sync) -> None:
    """``--local-sgd-interval``: after :func:`load_checkpoint`, put back this rank's replica (weights,
    inner optimizer state) and the outer state; under another layout, or from a checkpoint without
    them, every replica keeps the loaded weights and the outer state restarts from them (a warning).
    No communication."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    file = _local_sgd_file(path, rank)
    if common.get("layout") == _layout() and os.path.isfile(file):
        try:
            state = torch.load(file, weights_only=True)
        except (OSError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"cannot read {file}: {first_line(e)}") from None
        outer_sync.load_state_dict(state)
        return
    why = "it has none" if common.get("layout") == _layout() else f"it was saved with layout {common.get('layout')}"
    outer_sync.reset()
    logger.warning(
        f"local SGD: the replicas' own weights and optimizer states are not restored from {path} ({why}, now "
        f"{_layout()}): every replica starts from the checkpoint's weights, the outer state from them"
    )


def load_rng_state(path: str, common: dict) -> None:
    """Collective (one ``all_gather_object``).  Restore this rank's RNG states (skipped, with a
    message, when the layout changed)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not common.get("rng_saved", True):
        raise CheckpointError(f"{path} was saved with --no-save-rng: load it with --no-load-rng")
    if common.get("world_size") != world or common.get("layout") != _layout():
        logger.info(
            f"checkpoint was saved with layout {common.get('layout')}, now {_layout()}: RNG states are not restored"
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
