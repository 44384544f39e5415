"""Megatron-LM's two checkpoint layouts read as full tensors under per-layer names, from one process.

``torch_dist`` (``metadata.json`` ``{"sharded_backend": "torch_dist"}``): a
``torch.distributed.checkpoint`` directory whose keys are global: the decoder layers are STACKED
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, out, in]``), and a SwiGLU
``linear_fc1`` is ``[gate of every TP rank ; up of every TP rank]`` (newer Megatron may save the
halves as ``linear_fc1.weight_w`` / ``_v``).  ``.metadata`` is read by
:func:`megalm.safe_unpickle.load_metadata` (its pickled-object entries, such as the RNG state and
``_extra_state``, are listed but never read); tensors by DCP with ``torch.load(weights_only=True)``.

legacy (``mp_rank_XX[_YYY]/model_optim_rng.pt``, TP rank XX, PP rank YYY): each file holds its
rank's shards under stage-local layer numbers; :func:`merge_legacy` concatenates column-parallel
tensors on dim 0 (``linear_qkv``: each rank holds whole query groups, so the concatenation is
already megalm's grouped order; SwiGLU ``linear_fc1``: each rank holds ``[gate_r ; up_r]``, split
and regrouped), row-parallel ones on dim 1, the vocabulary on dim 0, and offsets the layer
numbers of each stage by the layers of the stages before it.

Both yield ``{name: tensor}`` with explicit layer numbers and Megatron's names (TE's fused norm
names included, ``_extra_state`` dropped); :mod:`megalm.conversion.megatron` maps them to megalm's.
No communication.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Dict, List, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megalm.conversion.errors import ConversionError
from megalm.conversion.megatron_args import refusals
from megalm.conversion.megatron_pickles import MegatronPickleError, checkpoint_args, load_megatron_pickle
from megalm.safe_unpickle import SafeFileSystemReader, load_metadata

STACKED_PREFIX = "decoder.layers."
_NUMBERED = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# Saved next to the model by Megatron, not model weights: keys under these prefixes are skipped.
NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state", "train_state")
_DIM0 = (".linear_qkv.weight", ".linear_qkv.bias", ".linear_fc1.weight", ".linear_fc1.bias")
_DIM0_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_DIM1 = (".linear_proj.weight", ".linear_fc2.weight")


def is_extra_state(name: str) -> bool:
    return name.endswith("_extra_state") or "._extra_state/" in name


# --- torch_dist ------------------------------------------------------------------------------


class TorchDistCheckpoint:
    """One ``iter_XXXXXXX`` directory of a ``torch_dist`` Megatron-LM checkpoint."""

    def __init__(self, path: str, read_args: bool = True):
        """``read_args`` False: ``common.pt`` is not opened (``args`` is None)."""
        self.path = path
        self.args = None
        if read_args:
            common = os.path.join(path, "common.pt")
            try:
                state = load_megatron_pickle(common)
            except MegatronPickleError as e:
                raise MegatronPickleError(
                    f"{e}. To import the weights without reading {common}, give the architecture as megalm flags "
                    f"with --ignore-saved-args"
                ) from None
            self.args = checkpoint_args(state, common)
        self.metadata = load_metadata(path, allow_byte_entries=True)
        tensors = {
            k: md for k, md in self.metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
        }
        self.model_keys = sorted(k for k in tensors if not k.startswith(NON_MODEL_PREFIXES) and not is_extra_state(k))
        self.optimizer_keys = sorted(k for k in tensors if k.startswith("optimizer."))
        self.shapes = {k: tuple(md.size) for k, md in tensors.items()}
        self.dtypes = {k: md.properties.dtype for k, md in tensors.items()}

    def load(self, keys: List[str]) -> Dict[str, torch.Tensor]:
        request = {k: torch.empty(self.shapes[k], dtype=self.dtypes[k]) for k in keys}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")
            dcp.load(
                request,
                storage_reader=SafeFileSystemReader(self.path, self.metadata),
                planner=DefaultLoadPlanner(),
                no_dist=True,
            )
        return request

    def layer_tensors(self, num_layers: int) -> Dict[str, torch.Tensor]:
        """Every model tensor, the stacked layer tensors unstacked into ``decoder.layers.{i}.*``."""
        out: Dict[str, torch.Tensor] = {}
        loaded = self.load(self.model_keys)
        for key in self.model_keys:
            t = loaded[key]
            if key.startswith(STACKED_PREFIX) and not _NUMBERED.match(key):
                if t.shape[0] != num_layers:
                    raise ConversionError(
                        f"{self.path}: stacked {key} has {t.shape[0]} layers, the model config has --num-layers "
                        f"{num_layers}"
                    )
                rest = key[len(STACKED_PREFIX) :]
                for i in range(num_layers):
                    out[f"{STACKED_PREFIX}{i}.{rest}"] = t[i]
            else:
                out[key] = t
        return _join_swiglu_halves(out)


def _join_swiglu_halves(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``linear_fc1.weight_w`` / ``_v`` (gate / up saved apart) -> one ``linear_fc1.weight`` ``[gate ; up]``."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_w", "_v")) and ".linear_fc1." in name:
            base = name[:-2]
            if name.endswith("_w"):
                if base + "_v" not in tensors:
                    raise ConversionError(f"{name} has no matching {base}_v (the SwiGLU up half)")
                out[base] = torch.cat([t, tensors[base + "_v"]])
            continue
        out[name] = t
    return out


# --- legacy ----------------------------------------------------------------------------------

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def legacy_files(path: str) -> Dict[Tuple[int, int], str]:
    """``{(tp rank, pp rank): model_optim_rng.pt path}``, checked to be a complete TP x PP grid."""
    files = {}
    for entry in sorted(os.listdir(path)):
        found = _RANK_DIR.match(entry)
        if found and os.path.isfile(os.path.join(path, entry, "model_optim_rng.pt")):
            files[(int(found.group(1)), int(found.group(2) or 0))] = os.path.join(path, entry, "model_optim_rng.pt")
    others = sorted(e for e in os.listdir(path) if e.startswith("mp_rank_") and not _RANK_DIR.match(e))
    if others:
        raise ConversionError(
            f"{path}: {others[0]} is an expert-parallel legacy file (mp_rank_XX_YYY_ZZZ): mixture-of-experts "
            f"checkpoints are not imported"
        )
    if not files:
        raise ConversionError(f"{path}: no mp_rank_XX[_YYY]/model_optim_rng.pt files")
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    missing = [f"mp_rank_{t:02d}_{p:03d}" for t in range(tp) for p in range(pp) if (t, p) not in files]
    if missing:
        raise ConversionError(f"{path}: the legacy checkpoint is incomplete, missing {missing[:4]}")
    return files


def _merge_tp(name: str, shards: List[torch.Tensor], swiglu: bool) -> torch.Tensor:
    """One tensor from its TP shards (rank order)."""
    if len(shards) == 1:
        return shards[0]
    if swiglu and name.endswith((".linear_fc1.weight", ".linear_fc1.bias")):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name.endswith(_DIM0) or name in _DIM0_VOCAB:
        return torch.cat(shards, dim=0)
    if name.endswith(_DIM1):
        return torch.cat(shards, dim=1)
    for r, s in enumerate(shards[1:], 1):  # replicated (norms, row-parallel biases, positions)
        if not torch.equal(s, shards[0]):
            raise ConversionError(f"{name}: TP rank {r} holds a different copy than rank 0 (expected replicated)")
    return shards[0]


def _check_grid(args: dict, tp: int, pp: int, file: str) -> None:
    """The saved args must describe the directory's TP x PP files (and no model this import refuses)."""
    wrong = refusals(args)
    if wrong:
        raise ConversionError(f"{file}: megalm cannot represent this Megatron-LM model: {'; '.join(wrong)}")
    saved = (int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1))
    if saved != (tp, pp):
        raise ConversionError(
            f"{file}: the saved args give TP {saved[0]} x PP {saved[1]}, the directory holds TP {tp} x PP {pp} files"
        )


def merge_legacy(path: str) -> Tuple[dict, Dict[str, torch.Tensor], List[str]]:
    """``(args, full tensors by global name, notes)`` of the legacy checkpoint directory ``path``."""
    files = legacy_files(path)
    tp = 1 + max(t for t, _ in files)
    pp = 1 + max(p for _, p in files)
    args, merged, offset, has_optimizer, swiglu = None, {}, 0, False, False
    for stage in range(pp):
        per_rank = []
        for rank in range(tp):
            file = files[(rank, stage)]
            state = load_megatron_pickle(file)
            if args is None:
                args = checkpoint_args(state, file)
                swiglu = bool(args.get("swiglu"))
                _check_grid(args, tp, pp, file)
            if "model" not in state:
                found = sorted(k for k in state if k.startswith("model"))
                raise ConversionError(
                    f"{file}: no 'model' entry (found {found}): virtual-pipeline legacy checkpoints are not imported"
                )
            has_optimizer = has_optimizer or bool(state.get("optimizer"))
            per_rank.append({k: v for k, v in state["model"].items() if not is_extra_state(k)})
        names = list(per_rank[0])
        for r, sd in enumerate(per_rank[1:], 1):
            if sorted(sd) != sorted(names):
                raise ConversionError(f"{files[(r, stage)]}: holds other tensor names than TP rank 0 of its stage")
        layers = set()
        for name in names:
            if not isinstance(per_rank[0][name], torch.Tensor):
                raise ConversionError(f"{files[(0, stage)]}: model entry {name} is not a tensor")
            full = _merge_tp(name, [sd[name] for sd in per_rank], swiglu)
            numbered = _NUMBERED.match(name)
            if numbered:
                layers.add(int(numbered.group(1)))
                name = f"{STACKED_PREFIX}{offset + int(numbered.group(1))}.{numbered.group(2)}"
            if name in merged:
                raise ConversionError(f"{name} appears in two pipeline stages")
            merged[name] = full
        if layers and sorted(layers) != list(range(len(layers))):
            raise ConversionError(f"{files[(0, stage)]}: layer numbers {sorted(layers)} are not 0..n-1 of its stage")
        offset += len(layers)
    notes = [f"legacy checkpoint: TP {tp} x PP {pp} files merged ({offset} layers)"]
    if has_optimizer:
        notes.append("the optimizer state in model_optim_rng.pt was not imported (weights only)")
    return args, merged, notes
