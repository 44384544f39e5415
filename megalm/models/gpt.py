"""GPT decoder-only language model (one pipeline chunk of it).

    tokens [b, s] --embedding--> [s(/tp), b, h] --decoder layers--> final norm
           --output layer--> vocab-parallel logits [s, b, V/tp] --cross entropy--> loss [b, s]

* ``pre_process`` (first stage): embedding; otherwise the input comes from
  :meth:`GPTModel.set_input_tensor` (Megatron's pipelining interface).
* ``post_process`` (last stage): final norm, output layer (column parallel without gather:
  forward all-gathers the sequence under SP; backward all-reduces / reduce-scatters the
  input gradient) and the vocab-parallel cross entropy (three ``[s, b]`` all-reduces).
  With the fused cross entropy (the default) output layer and loss are one chunked
  function (:mod:`megalm.tensor_parallel.linear_cross_entropy`) that never materializes
  the logits; given ``loss_mask`` its backward is a scaling.
* ``fusion_plan``: which fused kernels the layers use (:mod:`megalm.fusions.backends`);
  by default planned from the config and what is installed.
* ``layer_numbers``: the GLOBAL 0-based layers of this chunk (see
  :func:`megalm.models.layer_split.layers_for_stage`); parameter names are global and are
  both the checkpoint keys and the init seeds.

Tied output weights: with ``pre_process`` and ``post_process`` on one rank the output layer
uses the embedding's Parameter.  When the last stage has no embedding it owns a copy
(``output_layer.weight``) initialized exactly like ``embedding.word_embeddings.weight``;
both are marked ``tied`` in their :class:`~megalm.tensor_parallel.param_info.ParamInfo`
(:meth:`GPTModel.tied_weights` lists them) and their grads are summed by
:func:`megalm.distributed.finalize_model_grads.allreduce_embedding_grads`.

Process groups: ``process_groups`` (a :class:`~megalm.parallel_state.ProcessGroups`, required:
whoever builds the model passes the bundle it built, :meth:`ProcessGroups.single` for one process) is passed down
explicitly: every tensor-parallel layer, the losses and the attention / MLP blocks get its
``tp`` group, MoE blocks its ``tp`` and ``ep`` groups; no submodule reads parallel_state.
Sequence parallelism is on when ``cfg.parallel.sequence_parallel`` and the TP size is above one.

RNG: ``rng_tracker`` (a :class:`~megalm.tensor_parallel.random.RNGStatesTracker`, e.g. the one
:func:`~megalm.tensor_parallel.random.model_parallel_manual_seed` returns) is the tracker every layer forks for
dropout on tensor-parallel activations and restores for recomputation (:attr:`GPTModel.rng_tracker`); a
rank's model chunks share the one the trainer seeded.  Without one the model makes a new, unseeded tracker:
fine without dropout, else seed it (``model_parallel_manual_seed(seed, groups, model.rng_tracker)``).

MoE run-time state (router metrics, auxiliary-loss backward factor) is the model's
:attr:`GPTModel.moe_state`, reached by the trainer through :meth:`GPTModel.set_aux_loss_scale`
and by the loss function through :meth:`GPTModel.moe_metrics`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn

from megalm.config import MegalmConfig, pad_vocab_size
from megalm.context_parallel import local_positions, split_sequence
from megalm.fusions.backends import FusionPlan, plan_fusions
from megalm.models.embedding import LanguageModelEmbedding
from megalm.parallel_state import ProcessGroups, group_rank, group_size
from megalm.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalm.tensor_parallel.initialization import initialize_weights
from megalm.tensor_parallel.layers import ColumnParallelLinear
from megalm.tensor_parallel.linear_cross_entropy import linear_cross_entropy
from megalm.tensor_parallel.param_info import set_param_info
from megalm.tensor_parallel.random import RNGStatesTracker
from megalm.transformer.moe.state import MoEState
from megalm.transformer.mtp import MultiTokenPrediction
from megalm.transformer.packed_seq import PackedSeqParams, PackedSequenceError, positions_in_segments
from megalm.transformer.rope import rotary_embedding
from megalm.transformer.transformer_block import TransformerBlock
from megalm.transformer.utils import init_std, sequence_parallel_enabled

WORD_EMBEDDING_NAME = "embedding.word_embeddings.weight"


def _padded_vocab_size(cfg: MegalmConfig, tp_size: int) -> int:
    m = cfg.model
    if m.vocab_size is None:
        raise ValueError("cfg.model.vocab_size is not set (set it from the tokenizer: megalm.config.set_vocab_size)")
    if m.padded_vocab_size is not None:
        return m.padded_vocab_size
    return pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp_size)


class GPTModel(nn.Module):
    def __init__(
        self,
        cfg: MegalmConfig,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: Optional[Sequence[int]] = None,
        fusion_plan: Optional[FusionPlan] = None,
        *,
        process_groups: ProcessGroups,
        rng_tracker: Optional[RNGStatesTracker] = None,
    ):
        super().__init__()
        m = cfg.model
        self.cfg = cfg
        self.process_groups = process_groups
        self.rng_tracker = RNGStatesTracker() if rng_tracker is None else rng_tracker
        self.tp_group = self.process_groups.tp
        self.fusion_plan = fusion_plan or plan_fusions(m, half_precision=cfg.training.bf16 or cfg.training.fp16)
        self.pre_process, self.post_process = pre_process, post_process
        self.tp_size = group_size(self.tp_group)
        self.sequence_parallel = sequence_parallel_enabled(cfg.parallel, self.tp_size)
        self.moe_state = MoEState()
        self.padded_vocab_size = _padded_vocab_size(cfg, self.tp_size)
        self.vocab_size = cfg.model.vocab_size
        self.share_embeddings_and_output_weights = not m.untie_embeddings_and_output_weights
        self.layer_numbers: List[int] = list(range(m.num_layers) if layer_numbers is None else layer_numbers)

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                m, self.padded_vocab_size, self.sequence_parallel, tp_group=self.tp_group, rng_tracker=self.rng_tracker
            )
        self.rotary = rotary_embedding(m)
        self.decoder = TransformerBlock(
            m,
            self.layer_numbers,
            self.process_groups,
            post_process,
            self.sequence_parallel,
            self.fusion_plan,
            moe_state=self.moe_state,
            cp_comm_type=cfg.parallel.cp_comm_type,
            rng_tracker=self.rng_tracker,
        )
        if post_process:
            self.output_layer = self._build_output_layer(m)
        self.mtp = self.mtp_embedding = None
        if post_process and m.mtp_num_layers:
            self._build_mtp(cfg)
        self._mark_shared_embedding()
        initialize_weights(self, cfg.training.seed, tp_group=self.tp_group, etp_group=self.process_groups.etp)

    def _build_output_layer(self, m) -> ColumnParallelLinear:
        reuse_embedding = self.share_embeddings_and_output_weights and self.pre_process
        layer = ColumnParallelLinear(
            m.hidden_size,
            self.padded_vocab_size,
            bias=False,
            gather_output=False,
            init_std=init_std(m),
            sequence_parallel=self.sequence_parallel,
            skip_weight_param_allocation=reuse_embedding,
            vocab_unpadded=m.vocab_size,
            tp_group=self.tp_group,
        )
        if self.share_embeddings_and_output_weights and not self.pre_process:
            layer.weight.init_name = WORD_EMBEDDING_NAME  # same values as the first stage's embedding
            set_param_info(layer.weight, copy_of=WORD_EMBEDDING_NAME)  # saved and loaded as the embedding
        return layer

    def _build_mtp(self, cfg: MegalmConfig) -> None:
        """The multi-token prediction block (last stage); without the embedding here (pipeline
        parallelism) it embeds with a copy of the word embedding (the tied output weight itself when
        embeddings are tied), marked ``tied``: its gradient is summed with the first stage's."""
        m = cfg.model
        self.mtp = MultiTokenPrediction(
            m,
            self.process_groups,
            self.sequence_parallel,
            self.fusion_plan,
            moe_state=self.moe_state,
            cp_comm_type=cfg.parallel.cp_comm_type,
            per_token_loss=cfg.training.calculate_per_token_loss,
            rng_tracker=self.rng_tracker,
        )
        if self.pre_process:
            return
        self.mtp_embedding = LanguageModelEmbedding(
            m, self.padded_vocab_size, self.sequence_parallel, tp_group=self.tp_group, rng_tracker=self.rng_tracker
        )
        if self.share_embeddings_and_output_weights:
            self.mtp_embedding.word_embeddings.weight = self.output_layer.weight
        else:
            self.mtp_embedding.word_embeddings.weight.init_name = WORD_EMBEDDING_NAME
            set_param_info(self.mtp_embedding.word_embeddings.weight, copy_of=WORD_EMBEDDING_NAME)

    def _mark_shared_embedding(self) -> None:
        if self.share_embeddings_and_output_weights and (self.pre_process or self.post_process):
            set_param_info(self.shared_embedding_or_output_weight(), tied=True)
        elif self.cfg.model.mtp_num_layers and self.pre_process != self.post_process:
            # untied, pipelined MTP: the first stage's embedding and the last stage's copy are summed
            weight = self.embedding.word_embeddings.weight if self.pre_process else None
            if self.post_process:
                weight = self.mtp_embedding.word_embeddings.weight
            set_param_info(weight, tied=True)

    def tied_weights(self) -> List[nn.Parameter]:
        """The tied word-embedding / output weights this chunk holds: the word embedding (first
        stage, also the output weight when the last stage is here) or the output layer's copy
        (last stage without embedding); empty when untied or on a middle stage."""
        if not self.share_embeddings_and_output_weights:
            mtp_copy = self.cfg.model.mtp_num_layers and self.pre_process != self.post_process
            if not mtp_copy:
                return []
            return [(self.embedding if self.pre_process else self.mtp_embedding).word_embeddings.weight]
        weight = self.shared_embedding_or_output_weight()
        return [] if weight is None else [weight]

    def shared_embedding_or_output_weight(self) -> Optional[nn.Parameter]:
        """The word embedding (first stage) or the output weight (last stage without embedding)."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def mtp_metrics(self) -> Dict[str, torch.Tensor]:
        """Pop the ``mtp_<k> loss`` values recorded since the last call ({} without MTP or in evaluation)."""
        return {} if self.mtp is None else self.mtp.pop_metrics()

    def moe_metrics(self) -> Dict[str, torch.Tensor]:
        """Pop what this model's MoE routers recorded since the last call ({} for a dense model or
        in evaluation); the loss function calls it after each micro-batch's forward."""
        return self.moe_state.pop_metrics()

    def set_aux_loss_scale(self, loss_scale: float, num_microbatches: int) -> None:
        """Before each training step: the MoE auxiliary losses' backward factor becomes
        ``loss_scale / num_microbatches`` (the main loss's) and unreported metrics are dropped."""
        self.moe_state.begin_training_step(loss_scale, num_microbatches)

    def set_input_tensor(self, input_tensor: Union[torch.Tensor, Sequence[torch.Tensor], None]) -> None:
        """Hidden states ``[s(/tp), b, h]`` from the previous pipeline stage (a one-element list is accepted)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel takes one input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def _rotary_tables(self, hidden: torch.Tensor, position_ids: Optional[torch.Tensor]):
        if self.rotary is None:
            return None, None
        seq_length = hidden.shape[0] * (self.tp_size if self.sequence_parallel else 1)
        cp = group_size(self.process_groups.cp)
        if position_ids is None and cp > 1:  # stages without data: this CP rank's global positions
            positions = local_positions(seq_length * cp, group_rank(self.process_groups.cp), cp, hidden.device)
            position_ids = positions.unsqueeze(0)
        return self.rotary.tables(position_ids, seq_length, hidden.device)

    def _mask_padded_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of padding ids (>= the tokenizer's vocabulary) are -inf.

        So padding rows never train (they stay zero), the softmax does not depend on how much
        padding the TP size implies, and checkpoints may drop those rows.
        """
        shard = logits.shape[-1]
        valid = max(0, self.vocab_size - group_rank(self.tp_group) * shard)
        if valid < shard:
            # In place on the fresh matmul output, touching only the padded columns (autograd
            # zeroes their gradient); a full masked copy of the logits cost ~10% of a CPU step.
            logits[..., valid:] = float("-inf")
        return logits

    def forward(
        self,
        tokens: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        inference_cache=None,
        loss_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """Per-token fp32 loss ``[b, s]`` (last stage, labels given), vocab-parallel logits
        ``[b, s, V/tp]`` (last stage, no labels), else hidden states ``[s(/tp), b, h]``.

        ``loss_mask`` ``[b, s]`` (optional, with labels): the weights the loss function will
        apply to the per-token losses; the fused cross entropy computes its gradients with
        them in the forward (any other weighting stays exact, at the cost of a recompute).

        ``inference_cache`` (generation, :class:`megalm.inference.kv_cache.KVCache`): ``tokens``
        continue the cached sequence; positions default to ``cache.offset ..`` and the cache
        advances by ``s`` after the forward.

        ``attention_mask`` (``--reset-attention-mask``, from :func:`megalm.training.get_batch`): boolean
        ``[b, 1, s, s]``, True where a token may attend (causal within its document); every stage of
        the pipeline takes it.  None: causal attention.

        ``packed_seq_params`` (``--qkv-format thd``, Megatron-core's argument): the same documents as
        cumulative sequence lengths over the ``b s`` packed tokens (:mod:`megalm.transformer.packed_seq`);
        attention runs per document without a mask and RoPE positions restart in every document (on
        every stage, whatever ``position_ids`` says; those still feed learned absolute position
        embeddings).  Not with ``attention_mask``.
        """
        if packed_seq_params is not None:
            if attention_mask is not None:
                raise PackedSequenceError("give attention_mask or packed_seq_params, not both")
            attention_mask = packed_seq_params  # the layers take the documents in either form
        if inference_cache is not None and position_ids is None:
            s = tokens.shape[1] if tokens is not None else self.decoder.input_tensor.shape[0]
            position_ids = torch.arange(
                inference_cache.offset, inference_cache.offset + s, device=tokens.device if tokens is not None else None
            ).unsqueeze(0)
        if self.pre_process:
            hidden = self.embedding(tokens, position_ids)
        else:
            hidden = self.decoder.input_tensor
            if hidden is None:
                raise RuntimeError("GPTModel without pre_process needs set_input_tensor() before forward")
        rotary_positions = position_ids
        if packed_seq_params is not None:  # positions within the documents; this CP rank's chunks of them
            cp_group = self.process_groups.cp
            rotary_positions = split_sequence(
                positions_in_segments(packed_seq_params), 1, group_rank(cp_group), group_size(cp_group)
            )
        rotary_cos, rotary_sin = self._rotary_tables(hidden, rotary_positions)
        if inference_cache is None:
            hidden = self.decoder(hidden, rotary_cos, rotary_sin, attention_mask=attention_mask)
        else:
            hidden = self.decoder(hidden, rotary_cos, rotary_sin, inference_cache=inference_cache)
            inference_cache.advance(hidden.shape[0])
        if not self.post_process:
            return hidden
        if self.mtp is not None and labels is not None and self.training and inference_cache is None:
            hidden = self.mtp(
                hidden,
                tokens,
                labels,
                loss_mask,
                position_ids,
                self.embedding if self.pre_process else self.mtp_embedding,
                self._per_token_losses,
                rotary_cos,
                rotary_sin,
                attention_mask,
            )
        if labels is not None:
            return self._per_token_losses(hidden, labels, loss_mask)
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        logits = self._mask_padded_vocab(self.output_layer(hidden, weight=weight))  # [s, b, V/tp]
        return logits.transpose(0, 1).contiguous()

    def _per_token_losses(
        self, hidden: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """Per-token fp32 cross entropy ``[b, s]`` of the output layer on ``hidden`` ``[s(/tp), b, h]``."""
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        if self.fusion_plan.cross_entropy != "unfused":
            losses = linear_cross_entropy(
                hidden,
                self.output_layer.weight if weight is None else weight,
                labels.transpose(0, 1),
                self.vocab_size,
                token_weight=None if loss_mask is None else loss_mask.transpose(0, 1),
                sequence_parallel=self.sequence_parallel,
                tp_group=self.tp_group,
            )
            return losses.transpose(0, 1).contiguous()
        logits = self._mask_padded_vocab(self.output_layer(hidden, weight=weight))  # [s, b, V/tp]
        losses = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1), tp_group=self.tp_group)
        return losses.transpose(0, 1).contiguous()
