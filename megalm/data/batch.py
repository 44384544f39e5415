"""Deliver one micro-batch to every rank of a tensor-parallel group (Megatron's ``get_batch_on_this_tp_rank``).

Only TP rank 0 reads data; :func:`get_batch_on_this_tp_rank` broadcasts its micro-batch to the
other TP ranks (``groups.tp``, source: its group rank 0).  As in Megatron, the first pipeline
stage needs ``tokens`` and ``position_ids``, the last stage ``labels`` and ``loss_mask``; keys a
stage does not need are None (every key on middle stages, which read nothing).  The returned dict
always has the four keys and ``document_ids`` (None unless ``--reset-attention-mask``).  Shapes
are ``[micro_batch_size, seq_length]``, known to every rank from the config passed in (a forward
step takes it from its model: ``unwrap_model(model).cfg``), so nothing but the data itself is
communicated.

With ``--reset-attention-mask`` every pipeline stage needs the documents (its attention is masked
by them): the reading rank's ``document_ids`` travel in the same broadcast as the other integer
keys, and middle stages read data too (:func:`megalm.data.loaders.rank_reads_data`).  Likewise
with ``--reset-position-ids`` and RoPE every stage needs ``position_ids`` (each stage's attention
rotates by them, and they restart in every document, so a stage cannot count them itself):
:func:`positions_on_every_stage`.

The model-side views of the batch (this context-parallel rank's sequence chunks, the document
attention mask) are made by :func:`megalm.training.batch.get_batch`, which the forward step calls.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megalm.device import get_device
from megalm.errors import MegalmError
from megalm.parallel_state import ProcessGroups, group_rank, group_size

KEYS = ("tokens", "labels", "loss_mask", "position_ids")
DOCUMENT_IDS = "document_ids"  # in a dataset item with --reset-attention-mask


class BatchError(MegalmError, ValueError):
    """A micro-batch that does not fit the configuration, or no configuration to size it."""


def _shape(cfg) -> Tuple[int, int]:
    if cfg is None:
        raise BatchError(
            "get_batch needs cfg (the micro-batch shape) under model parallelism: get_batch(data_iterator, cfg, groups)"
        )
    return cfg.training.micro_batch_size, cfg.model.seq_length


def positions_on_every_stage(cfg) -> bool:
    """Whether every pipeline stage needs the batch's ``position_ids``: ``--reset-position-ids`` with
    RoPE (the rotation of every layer's queries and keys follows positions that restart after each
    end-of-document token; without the reset a stage's positions are ``0 .. s-1``, which it makes
    itself)."""
    return cfg is not None and cfg.data.reset_position_ids and cfg.model.position_embedding_type == "rope"


def _stage_keys(
    groups: ProcessGroups, documents: bool, mtp: bool = False, positions: bool = False
) -> Tuple[Tuple[str, ...], bool]:
    """Integer keys this pipeline stage needs, and whether it needs the loss mask; ``documents``:
    every stage needs the document ids (``--reset-attention-mask``); ``mtp``: the last stage embeds
    the tokens too (``--mtp-num-layers``); ``positions``: every stage needs the position ids
    (:func:`positions_on_every_stage`)."""
    pp_rank, pp = group_rank(groups.pp), group_size(groups.pp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    embeds = first or (last and mtp)
    int_keys = (("tokens", "position_ids") if embeds else ("position_ids",) if positions else ()) + (
        ("labels",) if last else ()
    )
    return int_keys + ((DOCUMENT_IDS,) if documents else ()), last


def get_batch_on_this_tp_rank(data_iterator, cfg, groups: ProcessGroups) -> Dict[str, Optional[torch.Tensor]]:
    """Next micro-batch on this rank's device, broadcast within the tensor-parallel group ``groups.tp``
    (with ``document_ids``: None, or the documents under ``--reset-attention-mask``).

    ``cfg`` (a :class:`megalm.config.MegalmConfig`) sizes the receive buffers of ranks that do not
    read; it may be None for a model of one process without ``torch.distributed``
    (:meth:`ProcessGroups.single`: ``tp``, ``pp`` and ``cp`` None), whose batches are taken as they come."""
    device = get_device()
    if groups.tp is None and groups.pp is None and groups.cp is None:
        data = next(data_iterator)
        out = {k: data[k].to(device, non_blocking=True) for k in KEYS}
        out[DOCUMENT_IDS] = data[DOCUMENT_IDS].to(device) if DOCUMENT_IDS in data else None
        return out
    int_keys, need_mask = _stage_keys(
        groups,
        cfg is not None and cfg.data.reset_attention_mask,
        cfg is not None and bool(cfg.model.mtp_num_layers),
        positions_on_every_stage(cfg),
    )
    if not int_keys and not need_mask:
        return dict.fromkeys(KEYS + (DOCUMENT_IDS,))  # middle pipeline stage: activations come from before
    mbs, seq = _shape(cfg)
    tp_group = groups.tp
    if group_rank(tp_group) == 0:
        data = next(data_iterator)
        for k in int_keys + (("loss_mask",) if need_mask else ()):
            if tuple(data[k].shape) != (mbs, seq):
                raise BatchError(f"batch {k} has shape {tuple(data[k].shape)}, expected ({mbs}, {seq})")
        ints = torch.stack([data[k] for k in int_keys]).to(device, torch.int64) if int_keys else None
        mask = data["loss_mask"].to(device, torch.float32) if need_mask else None
    else:
        ints = torch.empty((len(int_keys), mbs, seq), dtype=torch.int64, device=device) if int_keys else None
        mask = torch.empty((mbs, seq), dtype=torch.float32, device=device) if need_mask else None
    if group_size(tp_group) > 1:
        src = dist.get_global_rank(tp_group, 0)
        for t in (ints, mask):
            if t is not None:
                dist.broadcast(t, src, group=tp_group)
    out: Dict[str, Optional[torch.Tensor]] = dict.fromkeys(KEYS + (DOCUMENT_IDS,))
    for i, k in enumerate(int_keys):
        out[k] = ints[i]
    out["loss_mask"] = mask
    return out
