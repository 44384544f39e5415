"""Megatron-LM's ``--ckpt-format fsdp_dtensor`` checkpoint (a Megatron-FSDP run) read from one process.

Megatron-LM (``megatron/training/checkpointing.py`` at commit d98e8a64: ``generate_state_dict``,
``preprocess_fsdp_dtensor_state_dict``, and the ``torch_dcp`` / ``fsdp_dtensor`` branch of ``save_checkpoint``)
saves the run's state dict with ``torch.distributed.checkpoint.save`` into ``iter_XXXXXXX/`` (tracker
``latest_checkpointed_iteration.txt``, as for torch_dist) with no ``metadata.json`` and no ``common.pt``.
DCP flattens the nested dict with dots, so the directory's ``.metadata`` lists::

    args, checkpoint_version, iteration             pickled objects (DCP byte entries: torch.save of each;
                                                    Megatron's converter from torch_dist wraps them in BytesIO)
    model.module.<name>                             the FSDP module's state_dict (DTensors: full global shapes)
    model.module.<...>.linear_fc1.weight_w / _v     a SwiGLU fc1 as its gate and up halves
    optimizer.state.module.module.module.<name>.<s> the distributed optimizer's per-parameter state
                                                    (distrib_optimizer.py ``sharded_param_state_fsdp_dtensor``:
                                                    ``exp_avg``, ``exp_avg_sq``, and ``step`` when the optimizer
                                                    keeps it per parameter)
    optimizer.param_to_group_meta.module.module.module.<name>.<field>   each parameter's group (lr, step...)
    opt_param_scheduler.<field>, rerun_state_machine.<...>, rng_state.<(pp, tp)>.<...>  (not read)

Megatron-FSDP's parameters are the fp32 main weights, so fp32 ``model.module.*`` tensors are also Adam's main
copy.  Names: the module tree's, with Transformer Engine's fused norm names (``linear_qkv.layer_norm_weight``)
and TEGroupedMLP's experts (``mlp.experts.linear_fc1.weight<index>``) mapped to the names that
:func:`megalm.conversion.megatron.to_megalm_names` takes.  Byte entries are read with the restricted
unpickler (:mod:`megalm.conversion.megatron_pickles`); tensors with ``torch.load(weights_only=True)``
(:class:`megalm.checkpoint.safe_metadata.SafeFileSystemReader`).  No communication.
"""

from __future__ import annotations

import argparse
import io
import os
from typing import Dict, List, Optional

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megalm.checkpoint.fsdp_dtensor import MODEL, OPTIMIZER_STATE, _sequential_name
from megalm.checkpoint.safe_metadata import load_metadata
from megalm.conversion.errors import ConversionError
from megalm.conversion.megatron_layouts import _join_swiglu_halves, is_extra_state, load_tensors
from megalm.conversion.megatron_pickles import load_megatron_object

GROUP_META = "optimizer.param_to_group_meta.module.module.module."
# Adam's per-parameter states read (Megatron's name -> the name megatron_optimizer.STATE_KEYS takes).
_STATES = ("exp_avg", "exp_avg_sq")


def is_plain_dcp(path: str) -> bool:
    """A DCP directory (``.metadata``) with neither megalm's ``common.json`` nor Megatron's ``metadata.json``."""
    return (
        os.path.isfile(os.path.join(path, ".metadata"))
        and not os.path.isfile(os.path.join(path, "common.json"))
        and not os.path.isfile(os.path.join(path, "metadata.json"))
    )


class FsdpDtensorCheckpoint:
    """One ``iter_XXXXXXX`` directory Megatron-LM wrote with ``--ckpt-format fsdp_dtensor``."""

    def __init__(self, path: str, read_args: bool = True):
        """``read_args`` False: the pickled ``args`` are not read (``args`` is None)."""
        self.path = path
        self.metadata = load_metadata(path, allow_byte_entries=True)
        entries = self.metadata.state_dict_metadata
        tensors = {k: md for k, md in entries.items() if isinstance(md, TensorStorageMetadata)}
        self.byte_keys = sorted(k for k, md in entries.items() if isinstance(md, BytesStorageMetadata))
        self.model_keys = sorted(k for k in tensors if k.startswith(MODEL) and not is_extra_state(k))
        if not self.model_keys:
            raise ConversionError(
                f"{path} is a plain torch.distributed.checkpoint without model.module.* tensors: not Megatron-FSDP's "
                f"fsdp_dtensor format (Megatron-LM's torch_dcp format is not imported; save with --ckpt-format "
                f"torch_dist or fsdp_dtensor)"
            )
        self.optimizer_keys = sorted(k for k in tensors if k.startswith(OPTIMIZER_STATE))
        self.shapes = {k: tuple(md.size) for k, md in tensors.items()}
        self.dtypes = {k: md.properties.dtype for k, md in tensors.items()}
        self.args: Optional[dict] = None
        self.source = f"{path} (args)"
        if read_args:
            args = self.entry("args")
            if not isinstance(args, argparse.Namespace):
                raise ConversionError(
                    f"{path} has no Megatron-LM args entry (found {type(args).__name__}): cannot tell the model's "
                    f"architecture (give it as megalm flags with --ignore-saved-args)"
                )
            self.args = dict(vars(args))

    def entry(self, key: str):
        """The pickled object of byte entry ``key`` (None when there is none), read without running code."""
        info = next((v for k, v in self.metadata.storage_data.items() if k.fqn == key), None)
        if info is None:
            return None
        with open(os.path.join(self.path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        source = f"{self.path}/{info.relative_path} ({key})"
        obj = load_megatron_object(source, data)
        # tools/checkpoint/checkpoint_inspector.py (convert-torch-dist-to-fsdp-dtensor) saves torch.save bytes
        # as an io.BytesIO, which DCP pickles once more: unwrap it the same restricted way.
        return load_megatron_object(source, obj.getvalue()) if isinstance(obj, io.BytesIO) else obj

    def load(self, keys: List[str]) -> Dict[str, torch.Tensor]:
        return load_tensors(self.path, self.metadata, {k: (self.shapes[k], self.dtypes[k]) for k in keys})

    def model_tensors(self) -> Dict[str, torch.Tensor]:
        """The model's tensors under Megatron-core's per-layer names (SwiGLU halves joined ``[gate ; up]``)."""
        return _named(self.load(self.model_keys), MODEL)

    def optimizer_states(self, weights: Dict[str, torch.Tensor]) -> Dict[str, Dict[str, torch.Tensor]]:
        """``{exp_avg | exp_avg_sq | fp32_param: {name: tensor}}`` named like :meth:`model_tensors`; fp32 model
        ``weights`` (:meth:`model_tensors`) are the main copy (Megatron-FSDP's parameters); ``{}`` when no moments
        were saved."""
        out = {}
        for state in _STATES:
            keys = [k for k in self.optimizer_keys if k.endswith("." + state)]
            if keys:
                loaded = self.load(keys)
                out[state] = _named({k[: -len(state) - 1]: t for k, t in loaded.items()}, OPTIMIZER_STATE)
        if out and all(self.dtypes[k] == torch.float32 for k in self.model_keys):
            out["fp32_param"] = weights
        return out

    def adam_step(self) -> Optional[int]:
        """Adam's step: the per-parameter ``step`` states, else the parameter groups' ``step``, else the saved
        ``iteration``; None when they disagree or none is saved."""
        steps = [k for k in self.optimizer_keys if k.endswith(".step")]
        if steps:
            found = {int(t.reshape(-1)[0]) for t in self.load(steps).values()}
        else:
            found = {self.entry(k) for k in self.byte_keys if k.startswith(GROUP_META) and k.endswith(".step")}
            found = {int(s) for s in found if s is not None}
        if not found:
            iteration = self.entry("iteration")
            found = {int(iteration)} if isinstance(iteration, int) else set()
        return found.pop() if len(found) == 1 else None


def _named(loaded: Dict[str, torch.Tensor], prefix: str) -> Dict[str, torch.Tensor]:
    """``loaded`` without ``prefix``, TEGroupedMLP's expert names as SequentialMLP's, SwiGLU halves joined."""
    return _join_swiglu_halves({_sequential_name(k[len(prefix) :]): t for k, t in loaded.items()})
