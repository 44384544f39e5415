"""The compression state a checkpoint keeps per rank: error-feedback residuals, PowerSGD's
warm-start ``Q``s, the stochastic-rounding generator.

It is per rank (every data-parallel rank has its own residuals) and only meaningful for the
layout and settings it was made with (the residuals are laid out like the gradient buckets).
:func:`compression_state` collects it from the DDP-wrapped model chunks with a signature
(method, its settings, bucket size, distributed optimizer or not, parallel layout);
:func:`restore_compression_state` puts it back when the signature matches (resume is then
bit-exact) and otherwise says why not.

What any layout can load (:mod:`.reshard`) goes into the DCP checkpoint next to the weights:
:func:`layout_free_specs` (save) and :class:`LayoutFreeState` (load, then reshard when the per-rank
state does not match).  :class:`.checkpoint_state.CompressionCheckpointState` registers all of it with
the checkpointer and warns that the state restarts from zero only when the checkpoint has neither
(saved without compression, or by a megalm from before the pending updates were saved).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megalm.distributed.compression import reshard
from megalm.param_layout import ShardedTensorSpec, param_spec
from megalm.tensor_parallel.param_info import param_info


def _compressed_chunks(model_chunks: Sequence) -> list:
    return [(i, c) for i, c in enumerate(model_chunks) if getattr(c, "compressor", None) is not None]


def signature(model_chunks: Sequence, layout: dict) -> Optional[str]:
    """What the state depends on, as one string; None without compression."""
    chunks = _compressed_chunks(model_chunks)
    if not chunks:
        return None
    c = chunks[0][1]
    buckets = f"bucket size {c.bucket_size}" + (" (distributed optimizer)" if c.use_distributed_optimizer else "")
    return f"{c.compressor.signature}; {buckets}; chunks {len(model_chunks)}; layout {layout}"


def compression_state(model_chunks: Sequence, layout: dict) -> Optional[dict]:
    """``{"signature": str, "state": {"<chunk>/<key>": tensor}}`` of this rank, or None without
    compression (tensors are copied to the CPU)."""
    sig = signature(model_chunks, layout)
    if sig is None:
        return None
    state = {}
    for i, chunk in _compressed_chunks(model_chunks):
        for k, v in chunk.compressor.state_dict().items():
            state[f"{i}/{k}"] = v.detach().to("cpu", copy=True)
    return {"signature": sig, "state": state}


def restore_compression_state(model_chunks: Sequence, layout: dict, saved: Optional[dict]) -> Optional[str]:
    """Load ``saved`` (of :func:`compression_state`) into the chunks' compressors; returns None when
    restored (or nothing to restore), else why it was not (the state then starts from zero)."""
    sig = signature(model_chunks, layout)
    if sig is None:
        return None
    if saved is None:
        return "the checkpoint has no gradient-compression state (saved without --grad-compression)"
    if saved.get("signature") != sig:
        return f"it was saved for {saved.get('signature')}, this run is {sig}"
    for i, chunk in _compressed_chunks(model_chunks):
        prefix = f"{i}/"
        device = next(chunk.module.parameters()).device
        chunk.compressor.load_state_dict(
            {k[len(prefix) :]: v.to(device) for k, v in saved["state"].items() if k.startswith(prefix)}
        )
    return None


# --- the layout-independent part, in the DCP checkpoint (megalm.distributed.compression.reshard) ----------

PREFIX = "grad_compression."


def _q_key(name: str, first: int, end: int, tp: Tuple[int, int]) -> str:
    return f"{PREFIX}{name}.powersgd_q.rows{first}-{end}.tp{tp[0]}of{tp[1]}"


def _names(params: Dict[str, torch.nn.Parameter], copies: Dict[str, tuple]) -> Dict[torch.nn.Parameter, str]:
    """Parameter -> the name its pending update is saved under: its checkpoint name, or for the last
    stage's copy of a tied embedding ``<source>.copy`` (its residual is its own)."""
    names = {p: n for n, p in params.items()}
    names.update({p: f"{source}.copy" for source, p in copies.values()})
    return names


def layout_free_specs(
    model_chunks: Sequence, params: Dict[str, torch.nn.Parameter], copies: Dict[str, tuple], tp, *, groups
):
    """Save: ``grad_compression.<name>.pending`` (the pending update ``P`` of every parameter, laid out
    like it) and ``grad_compression.<name>.powersgd_q.rows<a>-<b>.tp<r>of<T>`` (PowerSGD's ``Q`` of
    rows ``[a, b)`` on TP rank ``r`` of ``T``, replicated over the data-parallel group).  ``params``
    and ``copies``: :func:`megalm.param_layout.model_parameters` / ``tied_embedding_copies``; ``tp``:
    ``(TP rank, TP size)``; ``groups``: the rank's process groups (where each parameter's shard
    sits).  Collective (:func:`~.reshard.pending_updates`); empty without compression."""
    names = _names(params, copies)
    specs = {}
    for p, pending in reshard.pending_updates(model_chunks).items():
        specs[f"{PREFIX}{names[p]}.pending"] = param_spec(p, pending, groups=groups)
    for (p, first, end), q in reshard.powersgd_qs(model_chunks).items():
        specs[_q_key(names[p], first, end, tp)] = ShardedTensorSpec.replicated(q.detach().clone())
    return specs


class LayoutFreeState:
    """Load: the tensors the DCP load fills (:attr:`specs`), then :meth:`apply` reshards them into
    the compressors.  Only what the checkpoint holds is read (``saved``: its names and shapes); a
    tied embedding's copy saved at PP > 1 and loaded at PP 1 (``absorb_copies``) adds to the source."""

    def __init__(self, model_chunks, params, copies, tp, saved: Dict[str, tuple], absorb_copies: bool, *, groups):
        names, copy_ids = _names(params, copies), {id(c) for _, c in copies.values()}
        self.specs: dict = {}
        self.pending: Dict[torch.nn.Parameter, List[torch.Tensor]] = {}
        self.qs: Dict[tuple, torch.Tensor] = {}
        for _, buf in reshard.compressed_buffers(model_chunks):
            for p in buf.param_index_map:
                keys = [f"{PREFIX}{names[p]}.pending"]
                if absorb_copies and param_info(p).tied and id(p) not in copy_ids:
                    keys.append(f"{PREFIX}{names[p]}.copy.pending")
                for key in (k for k in keys if k in saved):
                    target = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    self.specs[key] = param_spec(p, target, groups=groups)
                    self.pending.setdefault(p, []).append(target)
        for (p, first, end), shape in reshard.powersgd_q_shapes(model_chunks).items():
            key = _q_key(names[p], first, end, tp)
            if saved.get(key) == shape:
                self.qs[(p, first, end)] = torch.zeros(shape, dtype=torch.float32, device=p.device)
                self.specs[key] = ShardedTensorSpec.replicated(self.qs[(p, first, end)])

    @property
    def found(self) -> bool:
        return bool(self.pending)

    def apply(self, model_chunks) -> str:
        """Reshard the loaded tensors into the compressors; what was done, in words."""
        reshard.load_pending(model_chunks, {p: sum(ts) for p, ts in self.pending.items()})
        copied = reshard.load_powersgd_qs(model_chunks, self.qs)
        total = len(reshard.powersgd_q_shapes(model_chunks))
        qs = f"; PowerSGD Q copied for {copied} of {total} matrices (the others start fresh)" if total else ""
        return f"residuals = the pending update of {len(self.pending)} parameters / the ranks sharing it{qs}"
