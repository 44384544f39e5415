"""Deliver one micro-batch to every rank of a tensor-parallel group.

Only TP rank 0 reads data; :func:`get_batch` broadcasts its micro-batch to the other TP
ranks (``src = get_tensor_model_parallel_src_rank()`` within the TP group).  As in
Megatron, the first pipeline stage needs ``tokens`` and ``position_ids``, the last stage
``labels`` and ``loss_mask``; keys a stage does not need are None (every key on middle
stages, which read nothing).  The returned dict always has the four keys and ``attention_mask``.  Shapes are
``[micro_batch_size, seq_length]``, known to every rank from the config passed in (a forward
step takes it from its model: ``unwrap_model(model).cfg``), so nothing but the data itself is
communicated.

Under context parallelism every rank of a CP group reads the same micro-batch (the samplers
follow the data-parallel rank) and keeps its two sequence chunks of each key
(:func:`megalm.context_parallel.split_sequence`: chunks ``i`` and ``2CP-1-i`` of ``2CP`` for CP
rank ``i``), so its shapes are ``[micro_batch_size, seq_length / CP]``; the position ids are the
chunks' global positions.  No communication for the split.

With ``--reset-attention-mask`` every pipeline stage needs the documents (its attention is masked
by them): the reading rank's ``document_ids`` travel in the same broadcast as the other integer
keys, middle stages read data too (:func:`megalm.data.loaders.rank_reads_data`), and each rank
builds ``attention_mask`` (boolean ``[b, 1, s, s]``, True where attention is allowed:
:func:`megalm.transformer.attention_mask.document_causal_mask`) locally.  Without it
``attention_mask`` is None (causal attention).  Context parallelism is refused with it.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from megalm import parallel_state as ps
from megalm.context_parallel import split_sequence
from megalm.device import get_device
from megalm.errors import MegalmError
from megalm.transformer.attention_mask import document_causal_mask

KEYS = ("tokens", "labels", "loss_mask", "position_ids")
DOCUMENT_IDS = "document_ids"  # in a dataset item with --reset-attention-mask


class BatchError(MegalmError, ValueError):
    """A micro-batch that does not fit the configuration, or no configuration to size it."""


def _shape(cfg) -> Tuple[int, int]:
    if cfg is None:
        raise BatchError(
            "get_batch needs cfg (the micro-batch shape) under model parallelism: get_batch(data_iterator, cfg)"
        )
    return cfg.training.micro_batch_size, cfg.model.seq_length


def _stage_keys(documents: bool, mtp: bool = False) -> Tuple[Tuple[str, ...], bool]:
    """Integer keys this pipeline stage needs, and whether it needs the loss mask; ``documents``:
    every stage needs the document ids (``--reset-attention-mask``); ``mtp``: the last stage embeds
    the tokens too (``--mtp-num-layers``)."""
    first, last = ps.is_pipeline_first_stage(ignore_virtual=True), ps.is_pipeline_last_stage(ignore_virtual=True)
    int_keys = (("tokens", "position_ids") if first or (last and mtp) else ()) + (("labels",) if last else ())
    return int_keys + ((DOCUMENT_IDS,) if documents else ()), last


def _with_attention_mask(batch: Dict[str, Optional[torch.Tensor]], document_ids: Optional[torch.Tensor]):
    """The batch's ``attention_mask``: document-masked causal from ``document_ids`` ``[b, s]``, else None."""
    batch["attention_mask"] = None if document_ids is None else document_causal_mask(document_ids)
    return batch


def get_batch(data_iterator, cfg=None) -> Dict[str, Optional[torch.Tensor]]:
    """Next micro-batch on this rank's device, broadcast within the tensor-parallel group (with
    ``attention_mask``: None, or the document mask under ``--reset-attention-mask``).

    ``cfg`` (a :class:`megalm.config.MegalmConfig`) is needed once model parallelism is
    initialized: ranks that do not read size their receive buffers from it."""
    device = get_device()
    if not ps.model_parallel_is_initialized():
        data = next(data_iterator)
        documents = data[DOCUMENT_IDS].to(device) if DOCUMENT_IDS in data else None
        return _with_attention_mask({k: data[k].to(device, non_blocking=True) for k in KEYS}, documents)
    int_keys, need_mask = _stage_keys(
        cfg is not None and cfg.data.reset_attention_mask, cfg is not None and bool(cfg.model.mtp_num_layers)
    )
    if not int_keys and not need_mask:
        return dict.fromkeys(KEYS + ("attention_mask",))  # middle pipeline stage: activations come from before
    mbs, seq = _shape(cfg)
    src, tp = ps.get_tensor_model_parallel_src_rank(), ps.get_tensor_model_parallel_world_size()
    if ps.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        for k in int_keys + (("loss_mask",) if need_mask else ()):
            if tuple(data[k].shape) != (mbs, seq):
                raise BatchError(f"batch {k} has shape {tuple(data[k].shape)}, expected ({mbs}, {seq})")
        ints = torch.stack([data[k] for k in int_keys]).to(device, torch.int64) if int_keys else None
        mask = data["loss_mask"].to(device, torch.float32) if need_mask else None
    else:
        ints = torch.empty((len(int_keys), mbs, seq), dtype=torch.int64, device=device) if int_keys else None
        mask = torch.empty((mbs, seq), dtype=torch.float32, device=device) if need_mask else None
    if tp > 1:
        group = ps.get_tensor_model_parallel_group()
        for t in (ints, mask):
            if t is not None:
                dist.broadcast(t, src, group=group)
    out: Dict[str, Optional[torch.Tensor]] = dict.fromkeys(KEYS)
    for i, k in enumerate(int_keys):
        out[k] = ints[i]
    out["loss_mask"] = mask
    documents = out.pop(DOCUMENT_IDS, None)
    return _with_attention_mask(_context_parallel_chunks(out), documents)


def _context_parallel_chunks(batch: Dict[str, Optional[torch.Tensor]]) -> Dict[str, Optional[torch.Tensor]]:
    """This CP rank's two chunks of each ``[b, s]`` tensor (the batch itself at CP 1)."""
    cp = ps.get_context_parallel_world_size()
    if cp == 1:
        return batch
    rank = ps.get_context_parallel_rank()
    return {k: None if t is None else split_sequence(t, 1, rank, cp) for k, t in batch.items()}
