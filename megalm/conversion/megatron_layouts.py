"""Megatron-LM's two checkpoint layouts read as full tensors under per-layer names, from one process.

``torch_dist`` (``metadata.json`` ``{"sharded_backend": "torch_dist"}``): a
``torch.distributed.checkpoint`` directory whose keys are global: the decoder layers are STACKED
(``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, out, in]``), and a SwiGLU
``linear_fc1`` is ``[gate of every TP rank ; up of every TP rank]`` (newer Megatron may save the
halves as ``linear_fc1.weight_w`` / ``_v``).  ``.metadata`` is read by
:func:`megalm.checkpoint.safe_metadata.load_metadata` (its pickled-object entries, such as the RNG state and
``_extra_state``, are listed but never read); tensors by DCP with ``torch.load(weights_only=True)``.
Mixture-of-experts layers (megatron-core's ``SequentialMLP`` and ``TEGroupedMLP`` save the same keys)
stack the experts on an axis of their own: ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is
``[num_layers, num_experts, out, in]``; a stacked key is read for the layers its saved chunks cover.
megatron-core 0.19 saves a model whose ``--moe-layer-freq`` mixes dense and MoE layers with numbered
layers (``decoder.layers.1.mlp.experts.experts.linear_fc1.weight`` ``[num_experts, out, in]``), and with
``singleton_local_shards`` in its sharded-state-dict metadata (set by other frameworks, never by
Megatron-LM's ``save_checkpoint``) numbered layers, one key per expert
(``decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight``) and SwiGLU halves apart (``_w`` / ``_v``).

legacy (``mp_rank_XX[_YYY]/model_optim_rng.pt``, TP rank XX, PP rank YYY): each file holds its
rank's shards under stage-local layer numbers; :func:`merge_legacy` concatenates column-parallel
tensors on dim 0 (``linear_qkv``: each rank holds whole query groups, so the concatenation is
already megalm's grouped order; SwiGLU ``linear_fc1``: each rank holds ``[gate_r ; up_r]``, split
and regrouped), row-parallel ones on dim 1, the vocabulary on dim 0, and offsets the layer
numbers of each stage by the layers of the stages before it.  Expert-parallel files
(``mp_rank_XX[_YYY]_ZZZ``, EP rank ZZZ; with one suffix the saved args tell PP from EP) hold their
rank's ``num_experts / EP`` experts in one of three forms, all renamed to the global
``mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`` before the TP merge: ``SequentialMLP``'s
``local_experts.{local j}.``, ``TEGroupedMLP``'s ``linear_fc1.weight{local j}`` and the legacy
``GroupedMLP``'s ``weight1`` / ``weight2`` (``[h, E_local * out]`` / ``[E_local * in, h]``, viewed as
``[E_local, h, out]`` / ``[E_local, in, h]`` and transposed per expert).  Experts are split over TP
ranks like the dense MLP (expert-tensor-parallel size = TP size; other sizes are refused here).

Both yield ``{name: tensor}`` with explicit layer numbers and Megatron's names (TE's fused norm
names included, ``_extra_state`` dropped); :mod:`megalm.conversion.megatron` maps them to megalm's.
No communication.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megalm.checkpoint.safe_metadata import SafeFileSystemReader, load_metadata
from megalm.conversion.errors import ConversionError
from megalm.conversion.megatron_args import refusals
from megalm.conversion.megatron_flat_optimizer import flat_buckets
from megalm.conversion.megatron_pickles import MegatronPickleError, checkpoint_args, load_megatron_pickle

STACKED_PREFIX = "decoder.layers."
_NUMBERED = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# Saved next to the model by Megatron, not model weights: keys under these prefixes are skipped.
NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state", "train_state")
_DIM0 = (".linear_qkv.weight", ".linear_qkv.bias", ".linear_fc1.weight", ".linear_fc1.bias")
_DIM0_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_DIM1 = (".linear_proj.weight", ".linear_fc2.weight")
# Adam's moments and the fp32 main weights (``param`` in the fully_reshardable format): our name for each.
OPTIMIZER_STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "fp32_param", "param": "fp32_param"}


def is_extra_state(name: str) -> bool:
    return name.endswith("_extra_state") or "._extra_state/" in name


# --- torch_dist ------------------------------------------------------------------------------

COMMON_STATE_KEY = "common_state/shard_0_1"  # megatron-core >= 0.17: the common state inside DCP
# The distributed optimizer's param groups (with Adam's step) in its dp_reshardable format.
FLAT_OPTIMIZER_GROUPS_KEY = "optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1"


def load_tensors(path: str, metadata, wanted: Dict[str, Tuple[torch.Size, torch.dtype]]) -> Dict[str, torch.Tensor]:
    """The whole tensors ``wanted`` (key -> (shape, dtype)) of the DCP checkpoint at ``path``, read in one process
    through megalm's restricted reader (nothing in the checkpoint runs)."""
    request = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in wanted.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        dcp.load(
            request,
            storage_reader=SafeFileSystemReader(path, metadata),
            planner=DefaultLoadPlanner(),
            no_dist=True,
        )
    return request


def read_byte_entry(path: str, metadata, key: str) -> Optional[Tuple[object, str]]:
    """``(object, where it was read)`` of the DCP byte entry ``key`` (megatron-core's ``ShardedObject``:
    a ``torch.save`` of ``[object]``), unpickled like ``common.pt``; None when there is no such entry."""
    info = next((v for k, v in metadata.storage_data.items() if k.fqn == key), None)
    if info is None:
        return None
    source = f"{path}/{info.relative_path} ({key})"
    with open(os.path.join(path, info.relative_path), "rb") as f:
        f.seek(info.offset)
        data = f.read(info.length)
    return load_megatron_pickle(source, data), source


def read_common_state(path: str, metadata) -> Tuple[dict, str]:
    """``(common state dict, where it was read)``: ``common.pt`` when the directory has one, else the
    ``common_state`` byte entry of the DCP checkpoint."""
    common = os.path.join(path, "common.pt")
    try:
        found = None if os.path.isfile(common) else read_byte_entry(path, metadata, COMMON_STATE_KEY)
        return found if found is not None else (load_megatron_pickle(common), common)
    except MegatronPickleError as e:
        raise MegatronPickleError(
            f"{e}. To import the weights without reading the common state, give the architecture as megalm "
            f"flags with --ignore-saved-args"
        ) from None


class TorchDistCheckpoint:
    """One ``iter_XXXXXXX`` directory of a ``torch_dist`` Megatron-LM checkpoint."""

    def __init__(self, path: str, read_args: bool = True):
        """``read_args`` False: the common state is not read (``args`` is None)."""
        self.path = path
        self.args, self.common, self.common_source = None, {}, path
        self.metadata = load_metadata(path, allow_byte_entries=True)
        if read_args:
            state, self.common_source = read_common_state(path, self.metadata)
            self.args, self.common = checkpoint_args(state, self.common_source), state
        tensors = {
            k: md for k, md in self.metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
        }
        self.model_keys = sorted(k for k in tensors if not k.startswith(NON_MODEL_PREFIXES) and not is_extra_state(k))
        self.optimizer_keys = sorted(k for k in tensors if k.startswith("optimizer."))
        self.shapes = {k: tuple(md.size) for k, md in tensors.items()}
        self.dtypes = {k: md.properties.dtype for k, md in tensors.items()}
        self.chunks = {k: md.chunks for k, md in tensors.items()}

    def saved_layers(self, key: str) -> List[int]:
        """The layers (indices on dim 0) of stacked ``key`` that its saved chunks cover."""
        covered = set()
        for chunk in self.chunks[key]:
            covered.update(range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]))
        return sorted(covered)

    def load(self, keys: List[str]) -> Dict[str, torch.Tensor]:
        return load_tensors(self.path, self.metadata, {k: (self.shapes[k], self.dtypes[k]) for k in keys})

    def layer_tensors(self, num_layers: int) -> Dict[str, torch.Tensor]:
        """Every model tensor, the stacked layer tensors unstacked into ``decoder.layers.{i}.*``."""
        return self._unstacked(self.load(self.model_keys), "", num_layers)

    def optimizer_states(self, num_layers: int) -> Dict[str, Dict[str, torch.Tensor]]:
        """``{state: {model tensor name: tensor}}`` of the model-space optimizer state (the keys
        ``optimizer.state.<exp_avg | exp_avg_sq | fp32_param>.<model key>`` that megatron-core's plain
        optimizers and the distributed optimizer's ``fully_sharded_model_space`` format save, and
        ``optimizer.state.<exp_avg | exp_avg_sq | param>.<model key>`` of its ``fully_reshardable`` format,
        with the model keys' shapes), unstacked like the model; ``{}`` for states saved otherwise."""
        out = {}
        for state, ours in OPTIMIZER_STATES.items():
            prefix = f"optimizer.state.{state}."
            keys = [k for k in self.optimizer_keys if k.startswith(prefix)]
            if keys:
                out[ours] = self._unstacked(self.load(keys), prefix, num_layers)
        return out

    def flat_optimizer_buckets(self) -> List[Dict[str, torch.Tensor]]:
        """The distributed optimizer's ``dp_reshardable`` buckets (``{param | exp_avg | exp_avg_sq: flat
        tensor}``, in buffer and bucket order; :mod:`megalm.conversion.megatron_flat_optimizer`), ``[]``
        when it saved none; refused for more than one model-parallel rank's buffers."""
        buckets = flat_buckets(self.optimizer_keys)
        groups = sorted({key[0] for key in buckets})
        if len(groups) > 1:
            raise ConversionError(
                f"{self.path}: the distributed optimizer's flat buffers of {len(groups)} model-parallel ranks "
                f"(dp_group_idx {groups}): only a TP 1 x PP 1 run's are read"
            )
        out = []
        for key in sorted(buckets):
            loaded = self.load(list(buckets[key].values()))
            out.append({state: loaded[k] for state, k in buckets[key].items()})
        return out

    def _unstacked(self, loaded: Dict[str, torch.Tensor], prefix: str, num_layers: int) -> Dict[str, torch.Tensor]:
        """``loaded`` (full keys) without ``prefix``, stacked layer (and expert) axes split into names."""
        out: Dict[str, torch.Tensor] = {}
        for full_key, t in loaded.items():
            key = full_key[len(prefix) :]
            if key.startswith(STACKED_PREFIX) and not _NUMBERED.match(key):
                if t.shape[0] != num_layers:
                    raise ConversionError(
                        f"{self.path}: stacked {full_key} has {t.shape[0]} layers, the model config has --num-layers "
                        f"{num_layers}"
                    )
                rest = key[len(STACKED_PREFIX) :]
                for i in self.saved_layers(full_key):
                    out[f"{STACKED_PREFIX}{i}.{rest}"] = t[i]
            else:
                out[key] = t
        return _join_swiglu_halves(_split_experts(out))


_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)experts\.(?:(\d+)\.)?(.*)$")


def _split_experts(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A layer's ``mlp.experts.experts.<rest>`` ``[experts, ...]`` (or, saved with
    ``singleton_local_shards``, ``mlp.experts.experts.<j>.<rest>`` per expert) as
    ``mlp.experts.local_experts.<j>.<rest>``."""
    out = {}
    for name, t in tensors.items():
        found = _EXPERTS.match(name)
        if found is None:
            out[name] = t
        elif found.group(2) is not None:
            out[f"{found.group(1)}local_experts.{found.group(2)}.{found.group(3)}"] = t
        else:
            for j in range(t.shape[0]):
                out[f"{found.group(1)}local_experts.{j}.{found.group(3)}"] = t[j]
    return out


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

_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")


def legacy_files(path: str) -> Dict[Tuple[int, ...], str]:
    """``{(tp rank, *suffix numbers): model_optim_rng.pt path}`` of ``mp_rank_XX[_YYY][_ZZZ]``."""
    files = {}
    for entry in sorted(os.listdir(path)):
        found = _RANK_DIR.match(entry)
        if found and os.path.isfile(os.path.join(path, entry, "model_optim_rng.pt")):
            key = tuple(int(g) for g in found.groups() if g is not None)
            files[key] = os.path.join(path, entry, "model_optim_rng.pt")
    if not files:
        raise ConversionError(f"{path}: no mp_rank_XX[_YYY]/model_optim_rng.pt files")
    if len({len(k) for k in files}) > 1:
        raise ConversionError(f"{path}: mp_rank_ directories of mixed forms ({sorted(files)[:4]})")
    return files


def _grid(path: str, files: Dict[Tuple[int, ...], str], pp: int, ep: int) -> Dict[Tuple[int, int, int], str]:
    """``{(tp, pp, ep rank): file}`` from the directory names (one suffix: PP when ``pp`` > 1, else EP),
    checked to be the complete TP x PP x EP grid the saved args describe."""
    grid = {}
    for key, file in files.items():
        if len(key) == 1:
            grid[(key[0], 0, 0)] = file
        elif len(key) == 3:
            grid[key] = file
        else:
            grid[(key[0], key[1], 0) if pp > 1 else (key[0], 0, key[1])] = file
    tp = 1 + max(k[0] for k in grid)
    found = (tp, 1 + max(k[1] for k in grid), 1 + max(k[2] for k in grid))
    if found[1:] != (pp, ep):
        raise ConversionError(
            f"{path}: the saved args give PP {pp} x EP {ep}, the directory holds TP {found[0]} x PP {found[1]} x "
            f"EP {found[2]} files"
        )
    missing = [(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep) if (t, p, e) not in grid]
    if missing:
        raise ConversionError(f"{path}: the legacy checkpoint is incomplete, missing (tp, pp, ep) ranks {missing[:4]}")
    return grid


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(.*)$")
_TE_GROUPED = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_GROUPED = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)weight([12])$")


def _global_experts(sd: Dict[str, torch.Tensor], offset: int, local: int, hidden: int) -> Dict[str, torch.Tensor]:
    """One file's experts under global names ``...mlp.experts.local_experts.{offset + j}.linear_fc{1,2}.*``
    (from SequentialMLP's, TEGroupedMLP's or GroupedMLP's local names); other tensors unchanged."""
    out = {}
    for name, t in sd.items():
        seq, te, grouped = _LOCAL_EXPERT.match(name), _TE_GROUPED.match(name), _GROUPED.match(name)
        if seq:
            out[f"{seq.group(1)}local_experts.{offset + int(seq.group(2))}.{seq.group(3)}"] = t
        elif te:
            prefix, linear, kind, j = te.groups()
            out[f"{prefix}local_experts.{offset + int(j)}.{linear}.{kind}"] = t
        elif grouped:  # weight1 [h, E_l * out] is [E_l, h, out] in memory; weight2 [E_l * in, h] is [E_l, in, h]
            prefix, which = grouped.groups()
            per_expert = t.reshape(local, hidden, -1) if which == "1" else t.reshape(local, -1, hidden)
            for j in range(local):
                out[f"{prefix}local_experts.{offset + j}.linear_fc{which}.weight"] = per_expert[j].t().contiguous()
        else:
            out[name] = t
    return out


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


def _check_args(args: dict, tp: int, file: str) -> Tuple[int, int]:
    """``(PP, EP)`` of the saved args, which must describe the directory's TP size (and no model this
    import refuses)."""
    wrong = refusals(args)
    if wrong:
        raise ConversionError(f"{file}: megalm cannot represent this Megatron-LM model: {'; '.join(wrong)}")
    saved_tp = int(args.get("tensor_model_parallel_size") or 1)
    pp, ep = (int(args.get(k) or 1) for k in ("pipeline_model_parallel_size", "expert_model_parallel_size"))
    if saved_tp != tp:
        raise ConversionError(f"{file}: the saved args give TP {saved_tp} x PP {pp}, the directory holds TP {tp} files")
    etp = args.get("expert_tensor_parallel_size")
    if args.get("num_experts") and etp is not None and int(etp) != tp:
        raise ConversionError(
            f"{file}: --expert-tensor-parallel-size {etp} differs from TP {tp}: legacy files split that way are not "
            f"imported (save with --ckpt-format torch_dist)"
        )
    return pp, ep


def _load_model_state(file: str, state: dict) -> Dict[str, torch.Tensor]:
    if "model" not in state:
        found = sorted(k for k in state if k.startswith("model"))
        raise ConversionError(
            f"{file}: no 'model' entry (found {found}): virtual-pipeline legacy checkpoints are not imported"
        )
    sd = {k: v for k, v in state["model"].items() if not is_extra_state(k)}
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ConversionError(f"{file}: model entry {bad[0]} is not a tensor")
    return sd


def _merge_ep(
    grid: dict, tp_rank: int, stage: int, ep: int, args: dict, read: Dict[str, dict]
) -> Tuple[Dict[str, torch.Tensor], bool]:
    """TP rank ``tp_rank``'s tensors of pipeline stage ``stage``, its EP ranks' experts under global
    numbers (the other tensors must be the same in every EP rank's file); and whether any file held
    optimizer state.  ``read``: files already unpickled (used once, then dropped)."""
    merged, has_optimizer = {}, False
    local = int(args["num_experts"]) // ep if args.get("num_experts") else 0
    for e in range(ep):
        file = grid[(tp_rank, stage, e)]
        state = read.pop(file) if file in read else load_megatron_pickle(file)
        has_optimizer = has_optimizer or bool(state.get("optimizer"))
        sd = _global_experts(_load_model_state(file, state), e * local, local, int(args["hidden_size"]))
        for name, t in sd.items():
            if name in merged and not torch.equal(merged[name], t):
                raise ConversionError(f"{file}: {name} differs from EP rank 0's copy (expected replicated)")
            merged[name] = t
    return merged, has_optimizer


def merge_legacy(path: str) -> Tuple[dict, Dict[str, torch.Tensor], List[str]]:
    """``(args, full tensors by global name, notes)`` of the legacy checkpoint directory ``path``."""
    files = legacy_files(path)
    first = files[min(files)]
    read = {first: load_megatron_pickle(first)}
    args = checkpoint_args(read[first], first)
    tp = 1 + max(k[0] for k in files)
    pp, ep = _check_args(args, tp, first)
    grid = _grid(path, files, pp, ep)
    swiglu = bool(args.get("swiglu"))
    merged, offset, has_optimizer = {}, 0, False
    for stage in range(pp):
        per_rank = []
        for rank in range(tp):
            sd, optimizer = _merge_ep(grid, rank, stage, ep, args, read)
            per_rank.append(sd)
            has_optimizer = has_optimizer or optimizer
        names = list(per_rank[0])
        for r, sd in enumerate(per_rank[1:], 1):
            if sorted(sd) != sorted(names):
                raise ConversionError(f"{grid[(r, stage, 0)]}: holds other tensor names than TP rank 0 of its stage")
        layers = set()
        for name in names:
            full = _merge_tp(name, [sd[name] for sd in per_rank], swiglu)
            numbered = _NUMBERED.match(name)
            if numbered:
                layers.add(int(numbered.group(1)))
                name = f"{STACKED_PREFIX}{offset + int(numbered.group(1))}.{numbered.group(2)}"
            if name in merged:
                raise ConversionError(f"{name} appears in two pipeline stages")
            merged[name] = full
        if layers and sorted(layers) != list(range(len(layers))):
            raise ConversionError(f"{grid[(0, stage, 0)]}: layer numbers {sorted(layers)} are not 0..n-1 of its stage")
        offset += len(layers)
    notes = [f"legacy checkpoint: TP {tp} x PP {pp}{f' x EP {ep}' if ep > 1 else ''} files merged ({offset} layers)"]
    if has_optimizer:
        notes.append("the optimizer state in model_optim_rng.pt was not imported (weights only)")
    return args, merged, notes
