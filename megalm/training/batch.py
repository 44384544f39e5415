"""The forward step's micro-batch: read and broadcast over tensor parallelism, split over context
parallelism, and the document attention mask (Megatron's ``pretrain_gpt.get_batch``).

* :func:`megalm.data.batch.get_batch_on_this_tp_rank`: TP rank 0 reads, the others receive;
* :func:`megalm.context_parallel.get_batch_on_this_cp_rank`: this CP rank's two sequence chunks;
* with ``--reset-attention-mask`` each rank builds ``attention_mask`` (boolean ``[b, 1, s, s]``, True where
  attention is allowed: :func:`megalm.transformer.attention_mask.document_causal_mask`) from the
  documents; without it ``attention_mask`` is None (causal attention).  Context parallelism is
  refused with it (the packed form below runs under every ``--cp-comm-type``: the documents are the whole
  sequence's, the position ids this rank's chunks of them).
* with ``--qkv-format thd`` as well, ``packed_seq_params`` instead of the mask (the documents as cumulative
  sequence lengths, :func:`megalm.transformer.packed_seq.packed_seq_params_from_documents`; ``attention_mask``
  None) and ``position_ids`` restart in every document (:func:`~megalm.transformer.packed_seq.positions_in_segments`),
  so learned position embeddings see the positions RoPE uses.  Without it ``packed_seq_params`` is None.

The groups are the model's (``unwrap_model(model).process_groups``), passed in.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megalm.context_parallel import get_batch_on_this_cp_rank, split_sequence
from megalm.data.batch import DOCUMENT_IDS, get_batch_on_this_tp_rank
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.transformer.attention_mask import document_causal_mask
from megalm.transformer.packed_seq import packed_seq_params_from_documents, positions_in_segments


def get_batch(data_iterator, cfg, groups: ProcessGroups) -> Dict[str, Optional[torch.Tensor]]:
    """This rank's micro-batch: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (None where this
    pipeline stage needs none), ``attention_mask`` and ``packed_seq_params``.  ``cfg`` sizes the receive
    buffers of ranks that do not read (None only for a model of one process); ``groups``: this rank's
    :class:`megalm.parallel_state.ProcessGroups` (``tp``, ``pp``, ``cp`` are read)."""
    batch = get_batch_on_this_tp_rank(data_iterator, cfg, groups)
    documents = batch.pop(DOCUMENT_IDS)
    batch = get_batch_on_this_cp_rank(batch, groups.cp)
    batch["attention_mask"] = batch["packed_seq_params"] = None
    if documents is not None and cfg is not None and cfg.data.qkv_format == "thd":
        params = packed_seq_params_from_documents(documents)
        batch["packed_seq_params"] = params
        if batch["position_ids"] is not None:  # this CP rank's chunks of the positions within the documents
            cp = groups.cp
            batch["position_ids"] = split_sequence(positions_in_segments(params), 1, group_rank(cp), group_size(cp))
    elif documents is not None:
        batch["attention_mask"] = document_causal_mask(documents)
    return batch
