"""Read and write megalm checkpoints as FULL tensors from a single process.

A megalm checkpoint (:mod:`megalm.checkpoint`) stores every model tensor as blocks of its
full tensor keyed ``model.<global parameter name>`` (padded vocabulary rows dropped, a SwiGLU
``linear_fc1`` as ``[2, ffn, h]``), so whatever TP/PP layout saved it, one process can read
each full tensor without any process group.  Mixed-precision runs also hold the fp32 main
copy ``optimizer.<name>.main_param``: :meth:`MegalmCheckpointReader.load` prefers it.

Nothing from the checkpoint can run code: ``.metadata`` (a pickle written by
``torch.distributed.checkpoint``) is read by :mod:`megalm.checkpoint.safe_metadata` (an exact allow-list of
DCP's metadata classes, ``torch.Size``, dtypes and the layout); tensor data goes through DCP's
``torch.load(weights_only=True)``; ``common.json`` is JSON.

:func:`write_checkpoint` writes full tensors with :func:`megalm.save_sharded`
(replicated specs), a ``common.json`` and the tracker file, so any TP/PP layout can load it
(with ``--finetune`` or ``--no-load-optim``: it has no optimizer state).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from typing import Dict, Iterable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

from megalm.checkpoint import manifest as checkpoint_manifest
from megalm.checkpoint.common_json import FORMAT_VERSION, read_common
from megalm.checkpoint.errors import CheckpointError, describe_io_error
from megalm.checkpoint.resume import TRACKER_FILENAME, checkpoint_dir, find_checkpoint
from megalm.checkpoint.safe_metadata import SafeFileSystemReader, load_metadata
from megalm.config import MegalmConfig
from megalm.conversion.errors import ConversionError

MODEL_PREFIX = "model."
MAIN_PARAM_SUFFIX = ".main_param"


def tensor_entries(metadata: Metadata) -> Dict[str, tuple]:
    """``{key: (global shape, dtype)}`` of every tensor in the checkpoint."""
    return {key: (tuple(md.size), md.properties.dtype) for key, md in metadata.state_dict_metadata.items()}


class MegalmCheckpointReader:
    """One iteration directory of a megalm checkpoint root, read tensor by tensor.

    ``root`` is the ``--save`` directory (or an ``iter_XXXXXXX`` directory itself); the
    latest iteration is used unless ``iteration`` is given.
    """

    def __init__(self, root: str, iteration: Optional[int] = None):
        if not os.path.isdir(root):
            raise CheckpointError(f"checkpoint directory {root} does not exist")
        if os.path.isfile(os.path.join(root, "common.json")) and iteration is None:
            path = root
        else:
            path = find_checkpoint(root, iteration)
            if path is None:
                raise CheckpointError(f"no checkpoint in {root} (no {TRACKER_FILENAME}; give --iteration N)")
        self.path = path
        self.common = read_common(path)
        if self.common.get("ckpt_format", "torch_dist") != "torch_dist":
            raise CheckpointError(
                f"{path} is a --ckpt-format {self.common['ckpt_format']} checkpoint (Megatron-FSDP's tensor names): "
                "the convert and inspect tools read torch_dist ones; load it in a run with --auto-detect-ckpt-format "
                "(or --ckpt-format fsdp_dtensor) and save it with --ckpt-format torch_dist"
            )
        if not self.common.get("config"):
            raise CheckpointError(f"{path}/common.json has no config: cannot tell the model's architecture")
        self.config = MegalmConfig.from_dict(self.common["config"])
        self.entries = tensor_entries(load_metadata(path))
        self.model_names = sorted(k[len(MODEL_PREFIX) :] for k in self.entries if k.startswith(MODEL_PREFIX))

    @property
    def iteration(self) -> int:
        return int(self.common["iteration"])

    def has(self, name: str) -> bool:
        return MODEL_PREFIX + name in self.entries

    def shape(self, name: str) -> tuple:
        return self._entry(name)[0]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype the model weight was saved in (bf16 for a ``--bf16`` run)."""
        return self._entry(name)[1]

    def _entry(self, name: str) -> tuple:
        key = MODEL_PREFIX + name
        if key not in self.entries:
            raise ConversionError(
                f"checkpoint {self.path} has no tensor {key!r} (it has {len(self.model_names)} "
                f"model tensors, e.g. {self.model_names[:3]})"
            )
        return self.entries[key]

    def load(self, names: Iterable[str], prefer_main_param: bool = True) -> Dict[str, torch.Tensor]:
        """Full tensors of the model parameters ``names`` (fp32 main copies where saved)."""
        request: Dict[str, torch.Tensor] = {}
        source: Dict[str, str] = {}
        for name in names:
            shape, dtype = self._entry(name)
            main = "optimizer." + name + MAIN_PARAM_SUFFIX
            key = (
                main
                if prefer_main_param and main in self.entries and self.entries[main][0] == shape
                else MODEL_PREFIX + name
            )
            request[key] = torch.empty(self.entries[key][0], dtype=self.entries[key][1])
            source[name] = key
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")
            try:
                dcp.load(
                    request, storage_reader=SafeFileSystemReader(self.path), planner=DefaultLoadPlanner(), no_dist=True
                )
            except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
                raise CheckpointError(
                    f"failed to load {self.path}: {describe_io_error(e, self.path, writing=False)}"
                ) from None
        return {name: request[key] for name, key in source.items()}


def write_checkpoint(
    root: str,
    iteration: int,
    tensors: Dict[str, torch.Tensor],
    config: MegalmConfig,
    extra: Optional[dict] = None,
    optimizer: Optional[tuple] = None,
) -> str:
    """Write ``tensors`` (full, keyed by global parameter name) as a megalm checkpoint; ``optimizer``:
    ``(entries keyed optimizer.<name>.<state>, optimizer_common)`` to write beside them, or None.

    ``common.json`` records the config (its parallel section gives the intended layout),
    ``world_size`` None (so no RNG state is looked for) and ``extra``.  Returns the iteration
    directory; the tracker file is written last.
    """
    from megalm.checkpoint.dcp_io import save_sharded
    from megalm.param_layout import ShardedTensorSpec

    path = checkpoint_dir(root, iteration)
    if os.path.exists(path):
        raise ConversionError(f"{path} already exists: choose another --save-dir or --iteration")
    os.makedirs(path)
    specs = {MODEL_PREFIX + name: ShardedTensorSpec.replicated(t.contiguous()) for name, t in tensors.items()}
    if optimizer is not None:
        specs.update({key: ShardedTensorSpec.replicated(t.contiguous()) for key, t in optimizer[0].items()})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        save_sharded(specs, path)
    p = config.parallel
    common = {
        "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_train_samples": 0,
        "consumed_valid_samples": 0,
        "world_size": None,
        "layout": {
            "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "data_parallel_size": None,
            "expert_model_parallel_size": p.expert_model_parallel_size,
        },
        "config": config.to_dict(),
        "scheduler": None,
        "optimizer_common": None if optimizer is None else optimizer[1],
        "extra": extra or {},
        "saved_at": time.time(),
    }
    _write_atomic(os.path.join(path, "common.json"), json.dumps(common, indent=1))
    checkpoint_manifest.write_for_one_process(path, iteration)  # verified on load like a training checkpoint
    _write_atomic(os.path.join(root, TRACKER_FILENAME), str(iteration))
    return path


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
