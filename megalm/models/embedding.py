"""Input embedding of the GPT model: vocabulary-parallel word embedding, optional learned
absolute positions, embedding dropout.  Output ``[s, b, h]``, or ``[s/tp, b, h]`` under
sequence parallelism.

Communication, forward: without SP one all-reduce of ``[b, s, h]`` (word lookup).  Under SP
without learned positions the lookup is reduce-scattered along the sequence directly;
with learned positions it is all-reduced, positions are added and this rank keeps its
slice of the sequence.  Backward: nothing, or an all-gather along the sequence under SP
(so the replicated position table receives its full gradient on every rank).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megalm.device import get_device
from megalm.tensor_parallel.initialization import mark_init
from megalm.tensor_parallel.layers import VocabParallelEmbedding
from megalm.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megalm.tensor_parallel.random import RNGStatesTracker, dropout
from megalm.tensor_parallel.utils import set_tensor_model_parallel_attributes
from megalm.transformer.utils import init_std


class LanguageModelEmbedding(nn.Module):
    """See the module docstring; communicates over ``tp_group``; under sequence parallelism the
    dropout mask comes from ``rng_tracker``'s model-parallel stream (a new, unseeded tracker when None)."""

    def __init__(
        self,
        model_cfg,
        padded_vocab_size: int,
        sequence_parallel: bool = False,
        *,
        tp_group,
        rng_tracker: Optional[RNGStatesTracker] = None,
    ):
        super().__init__()
        m = model_cfg
        self.tp_group = tp_group
        self.rng_tracker = RNGStatesTracker() if rng_tracker is None else rng_tracker
        self.learned_positions = m.position_embedding_type == "learned_absolute"
        self.sequence_parallel = sequence_parallel
        self.embedding_dropout = m.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            padded_vocab_size,
            m.hidden_size,
            init_std=init_std(m),
            vocab_unpadded=m.vocab_size,
            reduce_scatter_to_sequence=sequence_parallel and not self.learned_positions,
            tp_group=self.tp_group,
        )
        if self.learned_positions:
            table = torch.empty(m.max_position_embeddings, m.hidden_size, dtype=torch.float32, device=get_device())
            # _weight skips nn.Embedding's own (RNG-consuming) init; initialize_weights fills it.
            self.position_embeddings = nn.Embedding(m.max_position_embeddings, m.hidden_size, _weight=table)
            set_tensor_model_parallel_attributes(self.position_embeddings.weight, False, -1)
            mark_init(self.position_embeddings.weight, "normal", init_std(m))

    def forward(self, token_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``token_ids``/``position_ids`` ``[b, s]`` -> ``[s(/tp), b, h]``."""
        words = self.word_embeddings(token_ids)
        if self.word_embeddings.reduce_scatter_to_sequence:
            embeddings = words  # already [s/tp, b, h]
        else:
            if self.learned_positions:
                if position_ids is None:
                    position_ids = torch.arange(token_ids.shape[1], device=token_ids.device).unsqueeze(0)
                words = words + self.position_embeddings(position_ids)
            embeddings = words.transpose(0, 1).contiguous()
            if self.sequence_parallel:
                embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)
        p, sp = self.embedding_dropout, self.sequence_parallel
        return dropout(embeddings, p, self.training, self.rng_tracker, model_parallel_rng=sp)
