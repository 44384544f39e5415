#!/usr/bin/env python
"""Pretrain a GPT model (Megatron-LM's pretrain_gpt.py, the megalm way).

    torchrun --nproc_per_node 4 pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 \\
        --micro-batch-size 4 --global-batch-size 16 --train-iters 200 --lr 3e-4 \\
        --data-path my-corpus_text_document --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model --save ckpt --save-interval 100

The four familiar parts: model provider, batch getter, loss function, forward step.
"""

from __future__ import annotations

from functools import partial

import torch

from megalm.config import MegalmConfig
from megalm.data import get_batch
from megalm.models import GPTModel
from megalm.training import pretrain
from megalm.transformer.moe import pop_moe_metrics


def model_provider(cfg: MegalmConfig, pre_process: bool = True, post_process: bool = True,
                   layer_numbers=None) -> GPTModel:
    """The GPT model chunk for this pipeline stage (its global layer numbers)."""
    return GPTModel(cfg, pre_process=pre_process, post_process=post_process, layer_numbers=layer_numbers)


def loss_func(loss_mask: torch.Tensor, model: torch.nn.Module, output_tensor: torch.Tensor):
    """Mean of the per-token losses over unmasked tokens of this microbatch; MoE models also
    report their routers' auxiliary losses and load statistics (their gradients are already
    attached to the backward pass by the routers)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach(), **pop_moe_metrics(model)}


def forward_step(data_iterator, model):
    """One microbatch: tokens in, per-token losses out (on the last stage)."""
    batch = get_batch(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"], model)


if __name__ == "__main__":
    pretrain(model_provider, forward_step)
