"""The document-masked causal attention mask of ``--reset-attention-mask``.

Position ``q`` may attend to position ``k`` when ``k <= q`` and both lie in the same document,
where a document ends at (and includes) an end-of-document token: exactly what Megatron's
``get_ltor_masks_and_position_ids`` builds (after an eod at ``i``, rows ``> i`` lose columns
``<= i``).  The mask is boolean ``[b, 1, s, s]`` with **True where attention is allowed** (PyTorch
SDPA's convention; Megatron's tensor is the opposite, True where masked), broadcast over heads.
Every row allows at least its diagonal, so no softmax row is empty.  No communication: every
rank builds it from the document ids :func:`megalm.training.get_batch` delivers.
"""

from __future__ import annotations

import torch


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """``document_ids`` ``[b, s]`` (non-decreasing per row) -> boolean ``[b, 1, s, s]``, True where
    query ``q`` may see key ``k``: ``k <= q`` and ``document_ids[q] == document_ids[k]``."""
    s = document_ids.shape[-1]
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)  # [b, q, k]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril_()
    return (same & causal).unsqueeze(1)
